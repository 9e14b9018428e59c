"""Leadership through etcd (gpu_worker/replication/lease.py) against a real three-member etcd
cluster on loopback: one holder of the leader key, its generation growing with every new holder,
and a holder that cannot renew its lease fenced before the lease could lapse."""
import json
import threading

import pytest

from gpu_worker.replication.lease import Etcd, LeaderWatch, Leadership, LeadershipError
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
    assert leadership.fenced() == leadership.lost and "expired" in leadership.lost
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
    watch = LeaderWatch(Etcd(etcd.endpoints), KEY, gone.set, holders.append)
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
