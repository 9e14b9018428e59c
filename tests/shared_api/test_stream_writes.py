"""An event stream's two write paths (shared_api/streams/events.py): frames the connection takes at once
are written from the device reader's turn of the loop (`on_frame`, the server's write_nowait);
the rest go through the queue to the stream's task — and the stream's bytes stay in frame order
whichever path each frame takes."""
import asyncio

from asgiref.sync import async_to_sync

from gpu_worker.contract.wire import Reply
from shared_api.device_client import DeviceStream
from shared_api.streams.events import ConversationEvents

PATH = "/aotx/v1/shared/conversations/con-x/events"


def frame(cursor, more=True, status=200):
    return Reply(id=1, status=status, more=more, event="event", cursor=str(cursor), body=b'{"n":%d}' % cursor)


def consumer(nowait):
    """A ConversationEvents whose response has started, fed by a DeviceStream; every byte it
    writes, by either path, lands in `out` in order."""
    out = []
    stream = ConversationEvents()
    stream.scope = {"type": "http", "path": PATH}
    stream.path, stream.path_bytes = PATH, PATH.encode()
    stream.stream = DeviceStream(mux=None, req_id=1)
    stream.gate = asyncio.Event()
    stream.gate.set()

    async def base_send(message):
        await stream.gate.wait()  # a connection that makes the write wait while the gate is shut
        out.append(message["body"])
    stream.base_send = base_send

    def write_nowait(chunk):
        if not nowait.pop(0):
            return False
        out.append(chunk)
        return True
    stream.write_nowait = write_nowait
    stream.stream.on_frame = stream.on_frame
    return stream, out


async def until(condition, what, timeout=30.0):
    """Run the loop (the stream's task) until condition() holds; bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.001)


def cursors(out):
    return [int(chunk.split(b"@", 1)[1].split(b"\n", 1)[0]) for chunk in out if chunk.startswith(b"id:")]


def test_frames_the_connection_takes_at_once_skip_the_task_and_the_rest_keep_their_order():
    async def go():
        # frame 2 would wait: it and every frame behind it in the queue go through the task
        stream, out = consumer([True, False, True, True, True, True])
        task = asyncio.get_running_loop().create_task(stream.pump())
        stream.stream.deliver(frame(1))
        assert cursors(out) == [1] and stream.stream.queue.empty()  # written in the reader's turn
        stream.gate.clear()  # the task's write of frame 2 will wait on the connection
        for cursor in (2, 3):
            stream.stream.deliver(frame(cursor))  # 3 is queued behind 2, not written ahead of it
        await until(lambda: stream.writing, "the task's write of frame 2 waiting on the connection")
        assert cursors(out) == [1]
        stream.stream.deliver(frame(4))  # the task's write still waits: queued too
        stream.gate.set()
        await until(lambda: stream.stream.queue.empty() and not stream.writing, "the task to write what was queued")
        assert cursors(out) == [1, 2, 3, 4]
        stream.stream.deliver(frame(5))  # the queue is empty again: at once
        assert cursors(out) == [1, 2, 3, 4, 5]
        stream.finished = True  # (no response to end in this test)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    async_to_sync(go)()


def test_the_last_frame_and_errors_always_go_through_the_task():
    stream, _ = consumer([True] * 4)
    assert not stream.on_frame(frame(9, more=False))  # finish() ends the response: the task's job
    assert not stream.on_frame(frame(9, status=403))
    stream.finished = True
    assert not stream.on_frame(frame(9))


class Mux:
    """The DeviceMux's side of a stream's close: recorded."""

    def __init__(self):
        self.closed = []

    async def _close(self, stream):
        self.closed.append(stream.id)


def backlogged_consumer(settings, limit):
    settings.AOTX_STREAM_BACKLOG_BYTES = limit
    stream, out = consumer([False] * 1000)  # no write is taken at once: every frame goes through the queue
    mux = Mux()
    stream.stream.mux = mux
    stream.stream.backlog_limit = limit
    stream.stream.on_backlog = stream.backlogged
    return stream, out, mux


def test_a_client_that_reads_slower_than_its_events_come_is_ended_not_buffered_without_end(settings):
    """A stream whose connection stops taking writes: its frames wait in the gateway's queue, and
    once more than AOTX_STREAM_BACKLOG_BYTES wait the stream ends — its subscription closes on the
    device, what waited is dropped, and the last event says why (`stream_backlog`)."""
    async def go():
        stream, out, mux = backlogged_consumer(settings, 100)
        stream.task = asyncio.get_running_loop().create_task(stream.pump())
        stream.gate.clear()  # the client stops reading
        stream.stream.deliver(frame(1))  # taken by the task, whose write now waits
        await until(lambda: stream.writing, "the task's write of frame 1 waiting on the connection")
        cursor = 2
        while stream.ending is None:
            assert cursor < 100, "the backlog was never bounded"
            stream.stream.deliver(frame(cursor))  # 8 body bytes each
            cursor += 1
        assert 100 < stream.stream.backlog <= 100 + len(frame(cursor - 1).body)  # the first frame past the bound
        stream.gate.set()  # the client reads again: the last event goes out
        await stream.ending
        assert mux.closed == [1] and stream.stream is None and stream.finished and stream.task.done()
        assert cursors(out) == [] and b"stream_backlog" in out[-1] and out[-1].startswith(b"event: error\n")
    async_to_sync(go)()


def test_the_backlog_counts_only_what_still_waits(settings):
    """Frames the task has taken no longer count: a stream that keeps up never ends."""
    async def go():
        stream, out, mux = backlogged_consumer(settings, 100)
        stream.task = asyncio.get_running_loop().create_task(stream.pump())
        for cursor in range(1, 200):
            stream.stream.deliver(frame(cursor))
            await until(lambda: stream.stream.queue.empty(), "the task to take the frame")
        assert stream.ending is None and stream.stream.backlog == 0 and cursors(out) == list(range(1, 200))
        stream.finished = True
        stream.task.cancel()
        await asyncio.gather(stream.task, return_exceptions=True)
    async_to_sync(go)()


def test_ending_a_stream_whose_client_never_reads_again_is_bounded(settings):
    """The last event cannot go out to a client that never reads: the stream still ends, after
    AOTX_DEVICE_TIMEOUT, with its subscription closed."""
    async def go():
        settings.AOTX_DEVICE_TIMEOUT = 0.05
        stream, out, mux = backlogged_consumer(settings, 10)
        stream.task = asyncio.get_running_loop().create_task(stream.pump())
        stream.gate.clear()
        for cursor in (1, 2, 3):  # 21 bytes wait whether or not the task took frame 1 (its write would wait)
            stream.stream.deliver(frame(cursor))
        assert stream.ending is not None
        await asyncio.wait_for(stream.ending, 30)
        assert mux.closed == [1] and stream.finished and out == []
    async_to_sync(go)()
