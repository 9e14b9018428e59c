"""GET /aotx/v1/shared/spaces/{spc}/memory (`memory.list`), GET /memory/{mem} (`memory.get`) and
POST /spaces/{spc}/publications (`publications.record`): what each sends to the device and what
it refuses without calling it."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, MALFORMED_BODIES, action_of,
                       assert_error, assert_passed_through, assert_request, assert_unauthenticated, bad_ids,
                       envelope, lacking, memory_id, mutation_args, space_id)


def list_path(space):
    return f"{BASE}/spaces/{space}/memory"


def detail_path(memory):
    return f"{BASE}/memory/{memory}"


def publish_path(space):
    return f"{BASE}/spaces/{space}/publications"


def publication(**changes):
    return envelope(**{"sequence": "4", "source": memory_id(), "source_version": "1", **changes})


READ_PATHS = [("memory.list", lambda: list_path(space_id())), ("memory.get", lambda: detail_path(memory_id()))]


@pytest.mark.parametrize("op, make", READ_PATHS, ids=[r[0] for r in READ_PATHS])
@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_reads_refuse_a_missing_malformed_or_unknown_token(gateway, device, people, op, make, authorization):
    assert_unauthenticated(gateway.get(make(), authorization=authorization))
    assert device.requests == []


@pytest.mark.parametrize("op, make", READ_PATHS, ids=[r[0] for r in READ_PATHS])
def test_reads_refuse_a_principal_without_the_read_action(gateway, device, people, op, make):
    for name in lacking(action_of(op)):
        assert_error(gateway.get(make(), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("spc"))
def test_the_list_rejects_a_malformed_space_id(gateway, device, people, bad):
    assert_error(gateway.get(list_path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("mem"))
def test_the_detail_rejects_a_malformed_memory_id(gateway, device, people, bad):
    assert_error(gateway.get(detail_path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_the_list_rejects_a_bad_limit(gateway, device, people, limit):
    assert_error(gateway.get(f"{list_path(space_id())}?limit={limit}", people["reader"]), 400, "bad_limit")
    assert device.requests == []


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_the_list_rejects_a_bad_cursor(gateway, device, people, cursor):
    assert_error(gateway.get(f"{list_path(space_id())}?cursor={cursor}", people["reader"]), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("offset", ["-1", "1.5", "abc", "", "0x10"])
def test_the_detail_rejects_a_bad_offset(gateway, device, people, offset):
    assert_error(gateway.get(f"{detail_path(memory_id())}?offset={offset}", people["reader"]), 400, "bad_offset")
    assert device.requests == []


def test_the_list_sends_the_space_cursor_and_limit(gateway, device, people):
    space = space_id()
    body = b'{"items":[],"next_cursor":null}'
    device.answer(200, body)
    persona = people[HOLDER[action_of("memory.list")]]
    assert_passed_through(gateway.get(f"{list_path(space)}?cursor=7&limit=3", persona), 200, body)
    assert_request(device.only_request(), "memory.list", persona.principal_id,
                   {"space": space, "cursor": "7", "limit": 3})


@pytest.mark.parametrize("query, offset", [("", 0), ("?offset=5", 5)])
def test_the_detail_sends_the_memory_and_the_offset(gateway, device, people, query, offset):
    memory = memory_id()
    device.answer(404, b'{"error":{"code":"memory_not_found","message":"no"}}')
    persona = people[HOLDER[action_of("memory.get")]]
    assert gateway.get(detail_path(memory) + query, persona).status_code == 404
    assert_request(device.only_request(), "memory.get", persona.principal_id, {"memory": memory, "offset": offset})


def test_the_detail_sends_the_version_it_must_be_at(gateway, device, people):
    memory = memory_id()
    refusal = b'{"error":{"code":"stale_version","message":"at 2","version":"2"}}'
    device.answer(409, refusal)
    persona = people[HOLDER[action_of("memory.get")]]
    assert_passed_through(gateway.get(detail_path(memory) + "?version=1&offset=3", persona), 409, refusal)
    assert_request(device.only_request(), "memory.get", persona.principal_id,
                   {"memory": memory, "offset": 3, "version": 1})


@pytest.mark.parametrize("version", ["0", "-1", "01", "1.5", "abc", "", str(1 << 64)])
def test_the_detail_rejects_a_bad_version(gateway, device, people, version):
    assert_error(gateway.get(f"{detail_path(memory_id())}?version={version}", people["reader"]), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_a_publication_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(publish_path(space_id()), body=publication(), authorization=authorization))
    assert device.requests == []


def test_a_publication_needs_the_manage_action(gateway, device, people):
    for name in lacking(action_of("publications.record")):
        assert_error(gateway.post(publish_path(space_id()), people[name], publication()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_a_publication_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(publish_path(space_id()), people["manager"], raw=make(publication())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("changes, code", [
    ({"source": "mem-nothex"}, "bad_id"), ({"source": 5}, "bad_id"),
    ({"source_version": 1}, "bad_field"), ({"source_version": "v1"}, "bad_field"),
    ({"source_version": "-1"}, "bad_field"), ({"source_version": str(1 << 63)}, "bad_field"),
    ({"source_version": "9" * 19}, "bad_field")])
def test_a_publication_refuses_bad_fields(gateway, device, people, changes, code):
    assert_error(gateway.post(publish_path(space_id()), people["manager"], publication(**changes)), 400, code)
    assert device.requests == []


def test_a_publication_requires_source_and_version_and_nothing_else(gateway, device, people):
    body = publication()
    del body["source_version"]
    assert_error(gateway.post(publish_path(space_id()), people["manager"], body), 400, "missing_field")
    assert_error(gateway.post(publish_path(space_id()), people["manager"], publication(extra=1)), 400,
                 "unknown_field")
    assert device.requests == []


def test_a_publication_sends_the_destination_and_its_fields(gateway, device, people):
    space = space_id()
    body = publication()
    persona = people[HOLDER[action_of("publications.record")]]
    for status, code in ((409, "stale_version"), (409, "unsupported_kind"), (507, "memory_full")):
        refusal = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
        device.answer(status, refusal)
        assert_passed_through(gateway.post(publish_path(space), persona, body), status, refusal)
    path = publish_path(space)
    assert_request(device.requests[0], "publications.record", persona.principal_id,
                   mutation_args(path, body, space=space, source=body["source"],
                                 source_version=body["source_version"]))
