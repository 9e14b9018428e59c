"""The device process: the socket server on DIR/service.sock and the owner thread.

The asyncio loop only moves frames; the owner thread runs Device.tick over whatever commands
arrived while the previous tick was committing (group commit falls out of this: the longer an
fdatasync takes, the larger the next batch). Replies are handed back to the loop once per tick.
"""
import asyncio
import logging
import os
import queue
import signal
import sys
import threading

from .protocol import PROTOCOL_VERSION, FrameBuffer, ProtocolError, encode_frame, reply

log = logging.getLogger("gpu_worker.server")
MAX_BATCH = 1024


class Connection(asyncio.Protocol):
    def __init__(self, server):
        self.server = server
        self.frames = FrameBuffer()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        try:
            msgs = self.frames.feed(data)
        except ProtocolError as exc:
            log.warning("closing connection: %s", exc)
            self.transport.close()
            return
        for msg in msgs:
            if msg.get("v") != PROTOCOL_VERSION:
                self.send([encode_frame(reply(msg.get("id"), 400, b'{"error":{"code":"protocol_version","message":"unsupported protocol version"}}'))])
                continue
            self.server.inbox.put((self, msg))

    def send(self, frames):
        if not self.transport.is_closing():
            self.transport.write(b"".join(frames))


class Server:
    def __init__(self, device, socket_path):
        self.device = device
        self.socket_path = socket_path
        self.inbox = queue.SimpleQueue()
        self.loop = None
        self.failure = None

    def _owner(self):
        deferred = []
        try:
            while True:
                batch = deferred
                if not batch:
                    item = self.inbox.get()
                    if item is None:
                        return
                    batch = [item]
                while len(batch) < MAX_BATCH:
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    batch.append(item)
                replies, deferred = self.device.tick(batch)
                by_conn = {}
                for conn, msg in replies:
                    by_conn.setdefault(conn, []).append(encode_frame(msg))
                for conn, frames in by_conn.items():
                    self.loop.call_soon_threadsafe(conn.send, frames)
        except BaseException as exc:  # a journal I/O error must stop the device so a restart recovers
            self.failure = exc
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def _serve(self):
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # we hold the journal lock, so no live device owns it
        server = await self.loop.create_unix_server(lambda: Connection(self), self.socket_path)
        os.chmod(self.socket_path, 0o660)
        return server

    def run(self, on_ready=None):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self._serve())
        owner = threading.Thread(target=self._owner, name="device-owner", daemon=True)
        owner.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.loop.stop)
        if on_ready:
            on_ready()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            self.inbox.put(None)
            owner.join(timeout=10)
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self.failure is not None:
            raise self.failure
