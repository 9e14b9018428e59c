"""RequestStats (shared_api/http/metrics.py) writes what prometheus-client's own Counter and Histogram
would for the same requests: the same families, labels, bucket counts and sums."""
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from shared_api.http.metrics import LATENCY_BUCKETS, RequestStats

REQUEST = st.tuples(st.sampled_from(["GET", "POST"]), st.sampled_from(["spaces", "operations/<str:operation>"]),
                    st.sampled_from([200, 202, 404]),
                    st.sampled_from([0.0, *LATENCY_BUCKETS, 31.0]) | st.floats(0, 40, allow_nan=False))


def exposition(registry):
    """The text exposition without the lines prometheus-client's own metrics add (_created)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@settings(max_examples=200, deadline=None)
@given(st.lists(REQUEST, max_size=30))
def test_request_stats_write_prometheus_clients_counter_and_histogram(requests):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    stats = RequestStats()
    ours.register(stats)
    counter = Counter("aotx_http_requests", "HTTP requests the gateway answered, by URL pattern",
                      ("method", "route", "status"), registry=theirs)
    histogram = Histogram("aotx_http_request_duration_seconds", "Time from request to response, by URL pattern",
                          ("method", "route"), buckets=LATENCY_BUCKETS, registry=theirs)
    for method, route, status, seconds in requests:
        stats.record(method, route, status, seconds)
        counter.labels(method, route, str(status)).inc()
        histogram.labels(method, route).observe(seconds)
    assert sorted(exposition(ours)) == sorted(exposition(theirs))
