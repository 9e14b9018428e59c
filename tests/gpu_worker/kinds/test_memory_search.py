"""`memory.search` at the device with the packed embedding model (tiny random weights): the rows
of a space's memory ranked by the cosine similarity of their embedding to the query's, with the
same visibility as the memory reads and recall (read right now, zero-rights fences)."""
import pytest
import torch

from gpu_worker.contract.limits import MAX_SEARCH_RESULTS
from tests.gpu_worker.kinds.test_inputs import EngineWorld, running
from tests.gpu_worker.kinds.test_memory import make_runtime, rows, run
from tests.gpu_worker.kinds.test_shared_state import code

TEXTS = ["the capital of france is paris", "my cat is called tom", "the meeting moved to tuesday",
         "paris has the eiffel tower"]


@pytest.fixture
def world(tmp_path):
    with running(EngineWorld(make_runtime(tmp_path), tmp_path, ["a", "b", "c"])) as w:
        yield w


def search(world, name, space, q, **args):
    return world.read(name, "memory.search", space=space, q=q, **args)


def test_search_ranks_the_spaces_rows_by_their_similarity_to_the_query(world):
    space, conversation = world.conversation("a")
    for text in TEXTS:
        run(world, "a", conversation, text)
    other, elsewhere = world.conversation("a")
    run(world, "a", elsewhere, "the capital of france is paris")  # another space's row: never found here
    status, body = search(world, "a", space, "the capital of france is paris")
    assert status == 200, body
    items = body["items"]
    listed = {row["object"]: row for row in rows(world, "a", space)}
    assert len(items) == len(TEXTS) and all(item["memory"] == listed[item["memory"]["object"]] for item in items)
    scores = [item["score"] for item in items]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1.000001 for s in scores)
    # the best is the row of the same text, and each score is the embeddings' cosine similarity
    embedder = world.device.embedder
    best = world.read("a", "memory.get", memory=items[0]["memory"]["object"])[1]["text"]
    assert best == "the capital of france is paris"
    vectors = embedder.encode(["the capital of france is paris", TEXTS[1]])
    cosine = float(torch.nn.functional.cosine_similarity(vectors[0], vectors[1], dim=0))
    [cat] = [item for item in items if world.read("a", "memory.get", memory=item["memory"]["object"])[1]["text"]
             == TEXTS[1]]
    assert cat["score"] == pytest.approx(cosine, abs=1e-4)
    assert [i["memory"]["object"] for i in search(world, "a", space, "paris", limit=2)[1]["items"]] == \
        [i["memory"]["object"] for i in search(world, "a", space, "paris")[1]["items"]][:2]


def test_search_sees_what_the_caller_may_read_now(world):
    space, conversation = world.conversation("a")
    run(world, "a", conversation, TEXTS[0])
    assert code(search(world, "b", space, "paris")) == (404, "space_not_found")  # not a member
    status, _ = world.member("a", space, "b", ["write"])
    assert status == 202
    assert code(search(world, "b", space, "paris")) == (403, "right_missing")  # no read right
    world.member("a", space, "b", ["read"])
    assert len(search(world, "b", space, "paris")[1]["items"]) == 1
    world.member("a", space, "b", [])  # a zero-rights row fences the space off
    assert code(search(world, "b", space, "paris")) == (404, "space_not_found")


@pytest.mark.parametrize("args, expected", [
    ({"q": ""}, (400, "bad_search_query")), ({"q": "   "}, (400, "bad_search_query")),
    ({"q": "x" * 2049}, (400, "bad_search_query")), ({"q": "x", "limit": 0}, (400, "bad_limit")),
    ({"q": "x", "limit": MAX_SEARCH_RESULTS + 1}, (400, "bad_limit")), ({"q": 5}, (400, "bad_search_query"))])
def test_a_malformed_search_is_refused(world, args, expected):
    space, _ = world.conversation("a")
    assert code(world.read("a", "memory.search", space=space, **args)) == expected


def test_an_empty_memory_answers_no_items(world):
    space, _ = world.conversation("a")
    assert search(world, "a", space, "anything") == (200, {"items": []})
