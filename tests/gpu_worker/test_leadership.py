"""Leadership through etcd (gpu_worker/replication/lease.py) against a real three-member etcd
cluster on loopback: one holder of the leader key, its generation growing with every new holder,
and a holder that cannot renew its lease fenced before the lease could lapse."""
import base64
import json
import threading
import time

import msgpack
import pytest

from bench.journal import registration_frame
from gpu_worker.contract.wire import encode_frame
from gpu_worker.replication.lease import (Etcd, LeaderWatch, Leadership, LeadershipError, boottime, may_promote,
                                          sync_key)
from tests.conftest import wait_for
from tests.etcd import EtcdCluster
from tests.gpu_worker.loop.test_server import LiveDevice, call

KEY = b"/aotx/test/primary"


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path).start()
    yield cluster
    cluster.stop()


class Clock:
    """A monotonic clock the test moves (a process stopped past its lease, without waiting)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_one_primary_holds_the_key_and_the_next_holder_has_a_higher_generation(etcd):
    first = Leadership(Etcd(etcd.endpoints), KEY, ttl=3)
    generation = first.campaign(b'{"name": "a"}')
    second = Leadership(Etcd(etcd.endpoints[::-1]), KEY, ttl=3)
    with pytest.raises(LeadershipError, match='another primary holds /aotx/test/primary .*"name": "a"'):
        second.campaign(b'{"name": "b"}')
    assert first.fenced() is None
    first.stop()  # a clean stop gives the key up at once
    third = Leadership(Etcd(etcd.endpoints), KEY, ttl=3)
    assert third.campaign(b'{"name": "c"}') > generation
    third.stop()


def test_a_primary_stopped_past_its_lease_is_fenced_the_moment_it_runs_again(etcd):
    clock = Clock()
    leadership = Leadership(Etcd(etcd.endpoints), KEY, ttl=3, margin=1.0, clock=clock)
    leadership.campaign(b"a")
    assert leadership.fenced() is None
    clock.now += 1.99  # within the lease, less the margin, from the campaign
    assert leadership.fenced() is None
    clock.now += 0.02  # 2 s: the margin before the lease could lapse
    assert "not renewed in time" in leadership.fenced()
    leadership.stop()


def test_a_primary_that_cannot_reach_etcd_is_fenced_and_stays_fenced_once_its_lease_is_gone(etcd):
    leadership = Leadership(Etcd(etcd.endpoints), KEY, ttl=2, margin=1.0)
    leadership.campaign(b"a")
    etcd.pause()  # no renewal reaches etcd
    try:
        wait_for(lambda: leadership.fenced() is not None, 10, what="the lease to stop being trusted")
        wait_for(lambda: leadership.trusted_until + 2.5 < leadership.clock(), 10, what="the lease to lapse")
    finally:
        etcd.resume()
    wait_for(lambda: leadership.lost is not None, 30, what="the renewal to learn the lease expired")
    # whichever it learns first once etcd answers: the renewal that the lease expired, or the watch
    # of its own key that the expiry deleted it
    assert leadership.fenced() == leadership.lost
    assert "expired" in leadership.lost or "was deleted" in leadership.lost, leadership.lost
    other = Leadership(Etcd(etcd.endpoints), KEY, ttl=2)
    wait_for(lambda: _try(other), 30, what="another primary to take the key")
    assert other.generation > leadership.generation and leadership.fenced() is not None
    other.stop()
    leadership.stop()


def _try(leadership):
    try:
        leadership.campaign(b"b")
    except LeadershipError:
        return False
    return True


def test_a_standby_sees_the_key_go_only_after_it_saw_it_held(etcd):
    """The watch follows the key through etcd's watch stream: each holder as it comes (a gateway's
    `on_holder`), then its end (a standby's `then`)."""
    gone = threading.Event()
    holders = []
    watch = LeaderWatch(Etcd(etcd.endpoints), KEY, lambda generation: gone.set() or True, holders.append)
    watch.start()
    try:
        holder = Leadership(Etcd(etcd.endpoints), KEY, ttl=3)
        holder.campaign(b"a")  # (no key before: not "gone", nothing was held yet)
        wait_for(lambda: watch.seen == holder.generation, 10, what="the watch to see the key held")
        assert not gone.is_set()
        holder.stop()
        assert gone.wait(10) and watch.gone
        assert holders == [(holder.generation, b"a"), None]
    finally:
        watch.stop()


def test_a_fenced_device_admits_nothing_and_still_answers_its_saved_receipts(tiny_runtime, tmp_path):
    clock = Clock()
    live = LiveDevice(tiny_runtime, tmp_path, 2).start()
    try:
        leadership = Leadership(Etcd(["http://127.0.0.1:9"]), KEY, ttl=3, clock=clock)  # (never asked: no campaign)
        leadership.trusted_until = clock.now + 10
        live.device.leadership = leadership
        first, second = live.principals
        with live.connect() as sock:
            frame = live.register_frame(first, 1)
            saved = call(sock, frame)
            assert saved["status"] == 202
            clock.now += 10  # the lease may have lapsed
            refused = call(sock, live.register_frame(second, 2))
            assert refused["status"] == 503
            assert json.loads(refused["body"])["error"]["code"] == "not_primary"
            again = call(sock, frame)  # the exact retry of a saved one: its receipt, from the saved state
            assert again["status"] == 200 and json.loads(again["body"]) == json.loads(saved["body"])
        assert live.device.pipeline_state()["leadership"]["fenced"] is not None
    finally:
        live.stop()


# ---- issue 52: the leader key itself, the sync key, the clock ---------------------------------------

def test_a_primary_whose_key_is_deleted_is_fenced_at_once_though_its_lease_lives(etcd):
    """`etcdctl del /aotx/primary` (a forced failover, an etcd restore) left the old primary
    admitting while its lease lived: two primaries answered "saved". It watches its own key now."""
    leadership = Leadership(Etcd(etcd.endpoints), KEY, ttl=30)  # a lease that would live on for 30 s
    leadership.campaign(b"a")
    assert leadership.fenced() is None
    Etcd(etcd.endpoints).call("/v3/kv/deleterange", {"key": base64.b64encode(KEY).decode()})
    wait_for(lambda: leadership.fenced() is not None, 5, what="the primary to fence itself")
    assert "was deleted" in leadership.fenced()
    with pytest.raises(LeadershipError):  # and it can no longer name a sync standby
        leadership.record_sync("0" * 32)
    leadership.stop()


def test_a_primary_whose_key_another_took_is_fenced(etcd):
    leadership = Leadership(Etcd(etcd.endpoints), KEY, ttl=30)
    leadership.campaign(b"a")
    etcd_client = Etcd(etcd.endpoints)
    etcd_client.call("/v3/kv/deleterange", {"key": base64.b64encode(KEY).decode()})
    other = Leadership(etcd_client, KEY, ttl=30)
    other.campaign(b"b")
    wait_for(lambda: leadership.fenced() is not None, 5, what="the old primary to fence itself")
    assert other.fenced() is None
    other.stop()
    leadership.stop()


def test_the_sync_key_names_the_standby_that_may_take_over_under_the_leaders_generation(etcd):
    client = Etcd(etcd.endpoints)
    leadership = Leadership(client, KEY, ttl=30)
    generation = leadership.campaign(b"a")
    member = "ab" * 16
    # a new primary names no standby: none may promote itself until one is in sync
    assert "names no standby" in may_promote(client, KEY, generation, member)
    leadership.record_sync(member)
    assert json.loads(client.get(sync_key(KEY))[1]) == {"leader": generation, "standby": member}
    assert may_promote(client, KEY, generation, member) is None
    assert "another standby" in may_promote(client, KEY, generation, "cd" * 16)
    assert "another leadership" in may_promote(client, KEY, generation - 1, member)
    leadership.record_sync(None)  # before saving alone
    assert "saved alone" in may_promote(client, KEY, generation, member)
    leadership.stop()


def test_the_lease_is_counted_on_clock_boottime_which_goes_on_while_the_machine_sleeps():
    leadership = Leadership(Etcd(["http://127.0.0.1:9"]), KEY)
    assert leadership.clock is boottime
    assert abs(boottime() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 1


def test_a_fenced_device_answers_not_primary_to_what_it_cannot_answer_with_a_receipt(tiny_runtime, tmp_path):
    """A deposed primary's state lags the new primary's: a refusal from it (a future sequence, a
    changed operation) told the SDK an operation the new primary had admitted was not, and the SDK
    submitted it anew (the fault harness found it: an exact retry answered 409 future_sequence)."""
    clock = Clock()
    live = LiveDevice(tiny_runtime, tmp_path, 1).start()
    try:
        leadership = Leadership(Etcd(["http://127.0.0.1:9"]), KEY, ttl=3, clock=clock)
        leadership.trusted_until = clock.now + 10
        live.device.leadership = leadership
        [principal] = live.principals
        with live.connect() as sock:
            assert call(sock, live.register_frame(principal, 1))["status"] == 202
            clock.now += 10
            lineage = live.device.state.participants.lineage_of(principal).hex()
            ahead = registration_frame(lineage, principal, 2)  # (a sequence the new primary may have admitted)
            frame = msgpack.unpackb(ahead[4:], raw=False)
            frame["args"]["sequence"] = 5
            reply = call(sock, encode_frame(frame))
            assert reply["status"] == 503 and json.loads(reply["body"])["error"]["code"] == "not_primary", reply
    finally:
        live.stop()
