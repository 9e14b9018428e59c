"""Who may call which shared route, through the real gateway and device (SPEC "Scope",
"Resources"; DESIGN §4): one table of the expected status for every (persona, route).

Rules the table encodes:
- no credential or a wrong one: 401 with WWW-Authenticate, on every route;
- the gateway action first: GET needs shared_read, POST participant/spaces/conversations/
  cancellations/retirements, a conversation's forks and a memory object's versions and deletion
  need shared_write, POST members, publications and space or conversation deletions need
  shared_manage (403 grant_missing);
- then the device: a resource the caller may not see is 404 (never 403), a visible resource
  without the needed right is 403 right_missing; the owner has every right, a member row gives
  exactly its rights, an instance space gives read+write to every registered participant unless a
  zero-rights row blocks it; current grants intersect with those stored rights; a memory object
  is corrected or forgotten with write on the space it was retained or published in by the
  participant that wrote it, with manage by any other; a conversation is forked with read on its
  space (the source's history is read: without it the source is 404, or 403 where the space is
  visible) and write there (the fork is a new conversation of that space);
- every response carries Cache-Control: no-store.

One stack serves the whole module. Each persona's own mutations change only that persona's
state (its own spaces, conversations, receipts and retry floor; member writes re-set an
existing zero-rights row; a space deletion that passes the rights stops at 409 space_not_empty,
and the conversation deletion names a conversation nobody has; a fork is a new conversation of
the persona's own, at the source's first input, which finished during setup, so the inputs other
personas add later never make it busy; the memory corrections and deletions name copies the
owner publishes afresh for each persona, in the private and the instance space, so what one
persona corrects or forgets no other route and no other persona names), so the persona tests do
not depend on each other's order.
"""
import json
import re
import secrets

import pytest

from tests.conftest import wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
SCHEMA = "aotx.shared.mutation.v1"
ALL_ACTIONS = "shared_read,shared_write,shared_manage"

# ---- routes: name -> (method, path template). Executed in this order for every persona: GETs
# first, then mutations, cancellation before retirement (which retires sequence 1) and
# registration last (so an unregistered persona stays unregistered for the other routes).
ROUTES = {
    "GET capabilities": ("GET", "/capabilities"),
    "GET participant": ("GET", "/participant"),
    "GET participants/{par}": ("GET", "/participants/{owner_par}"),
    "GET spaces": ("GET", "/spaces"),
    "GET spaces/{private}": ("GET", "/spaces/{private}"),
    "GET spaces/{instance}": ("GET", "/spaces/{instance}"),
    "GET spaces/{ghost}": ("GET", "/spaces/{ghost_space}"),
    "GET spaces/{private}/members": ("GET", "/spaces/{private}/members"),
    "GET spaces/{instance}/members": ("GET", "/spaces/{instance}/members"),
    "GET spaces/{private}/conversations": ("GET", "/spaces/{private}/conversations"),
    "GET spaces/{instance}/conversations": ("GET", "/spaces/{instance}/conversations"),
    "GET conversations/{private}": ("GET", "/conversations/{private_con}"),
    "GET conversations/{instance}": ("GET", "/conversations/{instance_con}"),
    "GET conversations/{ghost}": ("GET", "/conversations/{ghost_con}"),
    "GET operations": ("GET", "/operations"),
    "GET operations/{private}": ("GET", "/operations/{private_op}"),
    "GET operations/{instance}": ("GET", "/operations/{instance_op}"),
    "GET operations/{private}/result": ("GET", "/operations/{private_input}/result"),
    "GET conversations/{private}/events": ("GET", "/conversations/{private_con}/events"),
    "GET conversations/{instance}/events": ("GET", "/conversations/{instance_con}/events"),
    "GET operations/{private}/events": ("GET", "/operations/{private_input}/events"),
    "GET spaces/{private}/memory": ("GET", "/spaces/{private}/memory"),
    "GET spaces/{instance}/memory": ("GET", "/spaces/{instance}/memory"),
    "GET spaces/{private}/memory/search": ("GET", "/spaces/{private}/memory/search?q=paris"),
    "GET spaces/{instance}/memory/search": ("GET", "/spaces/{instance}/memory/search?q=paris"),
    "GET memory/{private}": ("GET", "/memory/{private_mem}"),
    "GET memory/{instance}": ("GET", "/memory/{instance_mem}"),
    "POST spaces": ("POST", "/spaces"),
    "POST spaces/{private}/members": ("POST", "/spaces/{private}/members"),
    "POST spaces/{instance}/members": ("POST", "/spaces/{instance}/members"),
    "POST spaces/{private}/conversations": ("POST", "/spaces/{private}/conversations"),
    "POST spaces/{instance}/conversations": ("POST", "/spaces/{instance}/conversations"),
    "POST conversations/{private}/inputs": ("POST", "/conversations/{private_con}/inputs"),
    "POST conversations/{instance}/inputs": ("POST", "/conversations/{instance_con}/inputs"),
    "POST conversations/{private}/forks": ("POST", "/conversations/{private_con}/forks"),
    "POST conversations/{instance}/forks": ("POST", "/conversations/{instance_con}/forks"),
    "POST spaces/{private}/deletion": ("POST", "/spaces/{private}/deletion"),
    "POST spaces/{instance}/deletion": ("POST", "/spaces/{instance}/deletion"),
    "POST conversations/{ghost}/deletion": ("POST", "/conversations/{ghost_con}/deletion"),
    "POST spaces/{private}/publications": ("POST", "/spaces/{private}/publications"),
    "POST spaces/{instance}/publications": ("POST", "/spaces/{instance}/publications"),
    # (a copy of the owner's, fresh for each persona: World.copies)
    "POST memory/{private}/versions": ("POST", "/memory/{private_copy}/versions"),
    "POST memory/{instance}/versions": ("POST", "/memory/{instance_copy}/versions"),
    "POST memory/{private}/deletion": ("POST", "/memory/{private_copy}/deletion"),
    "POST memory/{instance}/deletion": ("POST", "/memory/{instance_copy}/deletion"),
    "POST cancellations": ("POST", "/cancellations"),
    "POST retirements": ("POST", "/retirements"),
    "POST participant": ("POST", "/participant"),
}

# ---- expected results: a status, or (status, error code)
OK, NEW = 200, 202
GRANT = (403, "grant_missing")
RIGHT = (403, "right_missing")
NO_SPACE = (404, "space_not_found")
NO_CON = (404, "conversation_not_found")
NO_OP = (404, "operation_not_found")
NO_MEM = (404, "memory_not_found")
UNREG = (409, "participant_not_registered")
REGISTERED = (409, "already_registered")
NOT_CANCELLABLE = (409, "not_cancellable")
NOT_EMPTY = (409, "space_not_empty")
UNAUTH = (401, "unauthenticated")


def _everywhere(value):
    return {route: value for route in ROUTES}


# What each persona may do on the instance space without a member row: read + write.
_IMPLICIT_INSTANCE = {
    "GET spaces/{instance}": OK, "GET spaces/{instance}/members": OK,
    "GET spaces/{instance}/conversations": OK, "GET conversations/{instance}": OK,
    "GET operations/{instance}": OK,
    "POST spaces/{instance}/members": RIGHT, "POST spaces/{instance}/conversations": NEW,
    "POST conversations/{instance}/inputs": NEW, "POST spaces/{instance}/deletion": RIGHT,
    "GET spaces/{instance}/memory": OK, "POST spaces/{instance}/publications": RIGHT,
    "GET memory/{instance}": OK,
    # the owner wrote the object: changing it needs manage, which the implicit rights lack
    "POST memory/{instance}/versions": RIGHT, "POST memory/{instance}/deletion": RIGHT,
    "POST conversations/{instance}/forks": NEW,
}
_INVISIBLE_PRIVATE = {
    "GET spaces/{private}": NO_SPACE, "GET spaces/{private}/members": NO_SPACE,
    "GET spaces/{private}/conversations": NO_SPACE, "GET conversations/{private}": NO_CON,
    "GET operations/{private}": NO_OP,
    "POST spaces/{private}/members": NO_SPACE, "POST spaces/{private}/conversations": NO_SPACE,
    "POST conversations/{private}/inputs": NO_CON, "GET operations/{private}/result": NO_OP,
    "POST spaces/{private}/deletion": NO_SPACE,
    "GET spaces/{private}/memory": NO_SPACE, "GET memory/{private}": NO_MEM,
    "POST spaces/{private}/publications": NO_SPACE,
    "POST memory/{private}/versions": NO_MEM, "POST memory/{private}/deletion": NO_MEM,
    "POST conversations/{private}/forks": NO_CON,
}
_OWN_READS = {
    "GET capabilities": OK, "GET participant": OK, "GET participants/{par}": OK, "GET spaces": OK,
    "GET spaces/{ghost}": NO_SPACE, "GET conversations/{ghost}": NO_CON, "GET operations": OK,
}
_REGISTERED_WRITER = {
    "POST spaces": NEW, "POST cancellations": NOT_CANCELLABLE, "POST retirements": NEW,
    "POST participant": REGISTERED, "POST conversations/{ghost}/deletion": NO_CON,
}

EXPECTED = {
    # owns the private space and the instance space (and a conversation in each)
    "owner": {
        **_OWN_READS, **_REGISTERED_WRITER,
        "GET spaces/{private}": OK, "GET spaces/{instance}": OK,
        "GET spaces/{private}/members": OK, "GET spaces/{instance}/members": OK,
        "GET spaces/{private}/conversations": OK, "GET spaces/{instance}/conversations": OK,
        "GET conversations/{private}": OK, "GET conversations/{instance}": OK,
        "GET operations/{private}": OK, "GET operations/{instance}": OK,
        "POST spaces/{private}/members": NEW, "POST spaces/{instance}/members": NEW,
        "POST spaces/{private}/conversations": NEW, "POST spaces/{instance}/conversations": NEW,
        "POST conversations/{private}/inputs": NEW, "POST conversations/{instance}/inputs": NEW,
        "GET operations/{private}/result": OK,
        "POST spaces/{private}/deletion": NOT_EMPTY, "POST spaces/{instance}/deletion": NOT_EMPTY,
        "GET spaces/{private}/memory": OK, "GET spaces/{instance}/memory": OK, "GET memory/{private}": OK,
        "GET memory/{instance}": OK,
        "POST spaces/{private}/publications": NEW, "POST spaces/{instance}/publications": NEW,
        "POST memory/{private}/versions": NEW, "POST memory/{instance}/versions": NEW,
        "POST memory/{private}/deletion": NEW, "POST memory/{instance}/deletion": NEW,
        "POST conversations/{private}/forks": NEW, "POST conversations/{instance}/forks": NEW,
    },
    # member row [read] on the private space
    "reader": {
        **_OWN_READS, **_REGISTERED_WRITER, **_IMPLICIT_INSTANCE,
        "GET spaces/{private}": OK, "GET spaces/{private}/members": OK,
        "GET spaces/{private}/conversations": OK, "GET conversations/{private}": OK,
        "GET operations/{private}": OK,
        "POST spaces/{private}/members": RIGHT, "POST spaces/{private}/conversations": RIGHT,
        "POST conversations/{private}/inputs": RIGHT, "GET operations/{private}/result": OK,
        "POST spaces/{private}/deletion": RIGHT,
        "GET spaces/{private}/memory": OK, "GET memory/{private}": OK, "POST spaces/{private}/publications": RIGHT,
        "POST memory/{private}/versions": RIGHT, "POST memory/{private}/deletion": RIGHT,
        # it reads the source, but the fork would be a conversation of a space it may not write
        "POST conversations/{private}/forks": RIGHT,
    },
    # member row [write]: the space is visible but unreadable. A receipt is readable only where
    # its target space is readable (spaces.py receipt_visible_to), so the creating receipt is 404.
    "writer": {
        **_OWN_READS, **_REGISTERED_WRITER, **_IMPLICIT_INSTANCE,
        "GET spaces/{private}": RIGHT, "GET spaces/{private}/members": RIGHT,
        "GET spaces/{private}/conversations": RIGHT, "GET conversations/{private}": RIGHT,
        "GET operations/{private}": NO_OP,
        "POST spaces/{private}/members": RIGHT, "POST spaces/{private}/conversations": NEW,
        "POST conversations/{private}/inputs": NEW, "GET operations/{private}/result": NO_OP,
        "POST spaces/{private}/deletion": RIGHT,
        "GET spaces/{private}/memory": RIGHT, "GET memory/{private}": NO_MEM,
        "POST spaces/{private}/publications": RIGHT,
        "POST memory/{private}/versions": NO_MEM, "POST memory/{private}/deletion": NO_MEM,
        # write alone: the source is visible but its history unreadable
        "POST conversations/{private}/forks": RIGHT,
    },
    # member row [manage]
    "manager": {
        **_OWN_READS, **_REGISTERED_WRITER, **_IMPLICIT_INSTANCE,
        "GET spaces/{private}": RIGHT, "GET spaces/{private}/members": RIGHT,
        "GET spaces/{private}/conversations": RIGHT, "GET conversations/{private}": RIGHT,
        "GET operations/{private}": NO_OP,
        "POST spaces/{private}/members": NEW, "POST spaces/{private}/conversations": RIGHT,
        "POST conversations/{private}/inputs": RIGHT, "GET operations/{private}/result": NO_OP,
        "POST spaces/{private}/deletion": NOT_EMPTY,
        # manage without read: the destination passes, the source (its memory) is not visible
        "GET spaces/{private}/memory": RIGHT, "GET memory/{private}": NO_MEM,
        "POST spaces/{private}/publications": NO_MEM,
        "POST memory/{private}/versions": NO_MEM, "POST memory/{private}/deletion": NO_MEM,
        "POST conversations/{private}/forks": RIGHT,
    },
    # registered, no member row anywhere
    "outsider": {**_OWN_READS, **_REGISTERED_WRITER, **_IMPLICIT_INSTANCE, **_INVISIBLE_PRIVATE},
    # registered, a zero-rights row on the instance space: that blocks implicit instance access,
    # to the memory retained in it too (through any other instance space as well: see below)
    "zero": {
        **_OWN_READS, **_REGISTERED_WRITER, **_INVISIBLE_PRIVATE,
        "GET spaces/{instance}": NO_SPACE, "GET spaces/{instance}/members": NO_SPACE,
        "GET spaces/{instance}/conversations": NO_SPACE, "GET conversations/{instance}": NO_CON,
        "GET operations/{instance}": NO_OP,
        "POST spaces/{instance}/members": NO_SPACE, "POST spaces/{instance}/conversations": NO_SPACE,
        "POST conversations/{instance}/inputs": NO_CON, "POST spaces/{instance}/deletion": NO_SPACE,
        "GET spaces/{instance}/memory": NO_SPACE, "POST spaces/{instance}/publications": NO_SPACE,
        "GET memory/{instance}": NO_MEM,
        "POST memory/{instance}/versions": NO_MEM, "POST memory/{instance}/deletion": NO_MEM,
        "POST conversations/{instance}/forks": NO_CON,
    },
    # every grant, never registered: sees nothing, every mutation but registration is 409
    "newcomer": {
        **_OWN_READS, **_INVISIBLE_PRIVATE,
        "GET spaces/{instance}": NO_SPACE, "GET spaces/{instance}/members": NO_SPACE,
        "GET spaces/{instance}/conversations": NO_SPACE, "GET conversations/{instance}": NO_CON,
        "GET operations/{instance}": NO_OP,
        "POST spaces": UNREG, "POST spaces/{private}/members": UNREG, "POST spaces/{instance}/members": UNREG,
        "POST spaces/{private}/conversations": UNREG, "POST spaces/{instance}/conversations": UNREG,
        "POST conversations/{private}/inputs": UNREG, "POST conversations/{instance}/inputs": UNREG,
        "POST cancellations": UNREG, "POST retirements": UNREG, "POST participant": NEW,
        "POST spaces/{private}/deletion": UNREG, "POST spaces/{instance}/deletion": UNREG,
        "POST conversations/{ghost}/deletion": UNREG,
        "GET spaces/{instance}/memory": NO_SPACE, "GET memory/{instance}": NO_MEM,
        "POST spaces/{private}/publications": UNREG, "POST spaces/{instance}/publications": UNREG,
        "POST memory/{private}/versions": UNREG, "POST memory/{instance}/versions": UNREG,
        "POST memory/{private}/deletion": UNREG, "POST memory/{instance}/deletion": UNREG,
        "POST conversations/{private}/forks": UNREG, "POST conversations/{instance}/forks": UNREG,
    },
    # the next three hold member rows [read, write, manage] on the private space; only the
    # missing grant limits them. Without shared_read: every GET is refused, mutations still work
    # (on the instance space its implicit read+write intersects with write+manage grants -> write).
    "no_read": {
        **_everywhere(GRANT), **_REGISTERED_WRITER,
        "POST spaces/{private}/members": NEW, "POST spaces/{instance}/members": RIGHT,
        "POST spaces/{private}/conversations": NEW, "POST spaces/{instance}/conversations": NEW,
        "POST conversations/{private}/inputs": NEW, "POST conversations/{instance}/inputs": NEW,
        "POST spaces/{private}/deletion": NOT_EMPTY, "POST spaces/{instance}/deletion": RIGHT,
        "POST spaces/{private}/publications": NO_MEM, "POST spaces/{instance}/publications": RIGHT,
        # write and manage without read: neither object is visible
        "POST memory/{private}/versions": NO_MEM, "POST memory/{instance}/versions": NO_MEM,
        "POST memory/{private}/deletion": NO_MEM, "POST memory/{instance}/deletion": NO_MEM,
        # both sources are visible (write), their history unreadable
        "POST conversations/{private}/forks": RIGHT, "POST conversations/{instance}/forks": RIGHT,
    },
    # without shared_write (registered first, then shared_write revoked: registering needs it)
    "no_write": {
        **_OWN_READS, **_IMPLICIT_INSTANCE,
        "GET spaces/{private}": OK, "GET spaces/{private}/members": OK,
        "GET spaces/{private}/conversations": OK, "GET conversations/{private}": OK,
        "GET operations/{private}": OK,
        "POST spaces": GRANT, "POST spaces/{private}/members": NEW, "POST spaces/{instance}/members": RIGHT,
        "POST spaces/{private}/conversations": GRANT, "POST spaces/{instance}/conversations": GRANT,
        "POST conversations/{private}/inputs": GRANT, "POST conversations/{instance}/inputs": GRANT,
        "GET operations/{private}/result": OK,
        "POST cancellations": GRANT, "POST retirements": GRANT, "POST participant": GRANT,
        "POST spaces/{private}/deletion": NOT_EMPTY, "POST conversations/{ghost}/deletion": NO_CON,
        "GET spaces/{private}/memory": OK, "GET memory/{private}": OK, "POST spaces/{private}/publications": NEW,
        "POST memory/{private}/versions": GRANT, "POST memory/{instance}/versions": GRANT,
        "POST memory/{private}/deletion": GRANT, "POST memory/{instance}/deletion": GRANT,
        "POST conversations/{private}/forks": GRANT, "POST conversations/{instance}/forks": GRANT,
    },
    # without shared_manage
    "no_manage": {
        **_OWN_READS, **_REGISTERED_WRITER, **_IMPLICIT_INSTANCE,
        "GET spaces/{private}": OK, "GET spaces/{private}/members": OK,
        "GET spaces/{private}/conversations": OK, "GET conversations/{private}": OK,
        "GET operations/{private}": OK,
        "POST spaces/{private}/members": GRANT, "POST spaces/{instance}/members": GRANT,
        "POST spaces/{private}/conversations": NEW,
        "POST conversations/{private}/inputs": NEW, "GET operations/{private}/result": OK,
        "POST spaces/{private}/deletion": GRANT, "POST spaces/{instance}/deletion": GRANT,
        "POST conversations/{ghost}/deletion": GRANT,
        "GET spaces/{private}/memory": OK, "GET memory/{private}": OK,
        "POST spaces/{private}/publications": GRANT, "POST spaces/{instance}/publications": GRANT,
        # shared_write passes the gateway; the missing grant cuts manage from its member row, which
        # the owner's object needs
        "POST memory/{private}/versions": RIGHT, "POST memory/{private}/deletion": RIGHT,
        "POST conversations/{private}/forks": NEW,
    },
    "anonymous": _everywhere(UNAUTH),
    "wrong_token": _everywhere(UNAUTH),
}

# An event read has exactly the rights of its conversation's read; an operation's event stream
# those of its result read (the stream ends at once: the input has finished).
for _row in EXPECTED.values():
    _row["GET conversations/{private}/events"] = _row["GET conversations/{private}"]
    _row["GET conversations/{instance}/events"] = _row["GET conversations/{instance}"]
    _row["GET operations/{private}/events"] = _row["GET operations/{private}/result"]
    # a memory search has exactly the rights of its space's memory list
    _row["GET spaces/{private}/memory/search"] = _row["GET spaces/{private}/memory"]
    _row["GET spaces/{instance}/memory/search"] = _row["GET spaces/{instance}/memory"]

# principal actions at creation (no_write gets all three and loses shared_write after registering)
ACTIONS = {
    "owner": ALL_ACTIONS, "reader": ALL_ACTIONS, "writer": ALL_ACTIONS, "manager": ALL_ACTIONS,
    "outsider": ALL_ACTIONS, "zero": ALL_ACTIONS, "newcomer": ALL_ACTIONS,
    "no_read": "shared_write,shared_manage", "no_write": ALL_ACTIONS,
    "no_manage": "shared_read,shared_write", "revokee": ALL_ACTIONS,
}
PRIVATE_ROWS = {"reader": ["read"], "writer": ["write"], "manager": ["manage"],
                "no_read": ["read", "write", "manage"], "no_write": ["read", "write", "manage"],
                "no_manage": ["read", "write", "manage"], "revokee": ["read"]}


def test_the_table_covers_every_persona_and_route():
    for persona, row in EXPECTED.items():
        assert set(row) == set(ROUTES), (persona, sorted(set(ROUTES) ^ set(row)))
    # ROUTES names every path of shared_api/routes/urls.py (each with its GET and/or POST)
    from shared_api.routes import urls
    shape = lambda text: re.sub(r"<[^>]*>|\{[^}]*\}", "*", text.lstrip("/").split("?")[0])  # noqa: E731
    assert {shape(str(p.pattern)) for p in urls.urlpatterns} == {shape(path) for _, path in ROUTES.values()}


def _json(body):
    try:
        return json.loads(body)
    except ValueError:
        return None


class World:
    def __init__(self, stack):
        self.stack = stack
        self.tokens = {}
        self.ids = {}

    def call(self, persona, method, path, body=None):
        token = {"anonymous": None, "wrong_token": "aotx_" + secrets.token_urlsafe(32)}.get(
            persona, self.tokens.get(persona))
        return self.stack.http(method, BASE + path, body, token=token)

    def envelope(self, persona):
        """The persona's own lineage and next sequence: from GET /participant, or (without
        shared_read) from the 409 details a mutation with a wrong lineage / future sequence returns."""
        if persona in ("anonymous", "wrong_token"):
            return {"schema": SCHEMA, "lineage": "ab" * 16, "operation_key": secrets.token_hex(16), "sequence": "1"}
        if "shared_read" in ACTIONS[persona]:
            status, _, body = self.call(persona, "GET", "/participant")
            assert status == 200, (persona, body)
            me = json.loads(body)
            lineage, sequence = me["lineage"], me["next_sequence"]
        else:
            # (a sequence past any the persona used: below its retry floor the answer is 410, whatever the lineage)
            probe = {"schema": SCHEMA, "lineage": "0" * 32, "operation_key": secrets.token_hex(16),
                     "sequence": "1000000"}
            status, _, body = self.call(persona, "POST", "/spaces", probe)
            assert status == 409 and json.loads(body)["error"]["code"] == "stale_lineage", (persona, body)
            lineage = json.loads(body)["error"]["lineage"]
            probe.update(lineage=lineage, sequence=str(1 << 40))
            status, _, body = self.call(persona, "POST", "/spaces", probe)
            if status == 409 and json.loads(body)["error"]["code"] == "future_sequence":
                sequence = json.loads(body)["error"]["next_sequence"]
            else:  # unregistered: the probe stops at participant_not_registered
                sequence = "1"
        return {"schema": SCHEMA, "lineage": lineage, "operation_key": secrets.token_hex(16), "sequence": sequence}

    def mutate(self, persona, path, **fields):
        status, headers, body = self.call(persona, "POST", path, {**self.envelope(persona), **fields})
        return status, headers, body

    def copies(self):
        """New memory objects for the routes that correct and forget one: the owner's copies of
        its retained objects, published into the space each was retained in (the same readers,
        the owner the writer of each)."""
        return {f"{where}_copy": _created(self.mutate("owner", f"/spaces/{self.params[where]}/publications",
                                                      source=self.params[f"{where}_mem"], source_version="1"))["target"]
                for where in ("private", "instance")}


def _created(result):
    status, _, body = result
    assert status == 202, body
    return json.loads(body)


@pytest.fixture(scope="module")
def world(tiny_runtime, tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("authz"), tiny_runtime)
    try:
        w = World(stack)
        for persona, actions in ACTIONS.items():
            w.tokens[persona] = stack.principal(persona, actions=actions)
        stack.boot_device()
        stack.serve()
        for persona in ACTIONS:
            if persona != "newcomer":
                _created(w.mutate(persona, "/participant"))
        for persona in ACTIONS:
            if "shared_read" in ACTIONS[persona]:
                w.ids[persona] = json.loads(w.call(persona, "GET", "/participant")[2])["id"]
        # no_read cannot read its own participant; the owner reads it through the member list below
        private = _created(w.mutate("owner", "/spaces"))
        instance = _created(w.mutate("owner", "/spaces", scope="instance"))
        # a second instance space, which zero may read: the instance's memory is shared through it,
        # and what zero's row blocks in the first must stay fenced there too
        open_instance = _created(w.mutate("owner", "/spaces", scope="instance"))
        private_con = _created(w.mutate("owner", f"/spaces/{private['target']}/conversations"))
        instance_con = _created(w.mutate("owner", f"/spaces/{instance['target']}/conversations"))
        private_input = _created(w.mutate("owner", f"/conversations/{private_con['target']}/inputs",
                                          text="hi", model="tiny-llama", max_output_tokens=2))
        instance_input = _created(w.mutate("owner", f"/conversations/{instance_con['target']}/inputs",
                                           text="the instance space's fact", model="tiny-llama",
                                           max_output_tokens=2))
        for persona, permissions in PRIVATE_ROWS.items():
            if persona == "no_read":
                continue
            _created(w.mutate("owner", f"/spaces/{private['target']}/members", participant=w.ids[persona],
                              permissions=permissions))
        _created(w.mutate("owner", f"/spaces/{instance['target']}/members", participant=w.ids["zero"],
                          permissions=[]))
        # no_read's participant id: a no_read mutation's receipt names it
        no_read_space = _created(w.mutate("no_read", "/spaces"))
        w.ids["no_read"] = no_read_space["participant"]
        _created(w.mutate("owner", f"/spaces/{private['target']}/members", participant=w.ids["no_read"],
                          permissions=PRIVATE_ROWS["no_read"]))
        # the inputs' retained sources: the memory objects the memory and publication routes name
        def retained(receipt):
            memory = json.loads(w.call("owner", "GET", f"/operations/{receipt['operation']}")[2])["memory"]
            return memory if memory["retained"] else None
        memory = wait_for(lambda: retained(private_input), 60, interval=0.05, what="the private input's memory")
        instance_memory = wait_for(lambda: retained(instance_input), 60, interval=0.05,
                                   what="the instance input's memory")
        stack.manage("principal", "revoke", "no_write", "--actions", "shared_write", "--config", str(stack.config))
        lineage = private["target"].split("-")[1]
        w.params = {
            "owner_par": w.ids["owner"], "private": private["target"], "instance": instance["target"],
            "ghost_space": f"spc-{lineage}-{'7' * 32}", "private_con": private_con["target"],
            "instance_con": instance_con["target"], "ghost_con": f"con-{lineage}-{'7' * 32}",
            "private_op": private["operation"], "instance_op": instance["operation"],
            "private_input": private_input["operation"], "private_mem": memory["retained"][0],
            "instance_mem": instance_memory["retained"][0], "open_instance": open_instance["target"],
        }
        yield w
    finally:
        stack.stop()


def _body_for(world, route):
    """Each mutation's own fields. Member writes re-set zero's zero-rights row (created on the
    instance space during setup; on the private space zero has no access either way), so a
    successful one changes nobody's access."""
    if route.startswith("POST spaces/") and route.endswith("/members"):
        return {"participant": world.ids["zero"], "permissions": []}
    if route.startswith("POST memory/") and route.endswith("/deletion"):
        return {"reason": "the matrix forgets it"}
    if route.endswith("/versions"):
        return {"text": "a corrected fact", "version": "1"}
    if route.endswith("/deletion"):
        return {}
    if route.endswith("/forks"):  # the source's first input, finished during setup
        return {"at": "1"}
    if route.startswith("POST conversations/"):
        return {"text": "hi", "model": "tiny-llama", "max_output_tokens": 2}
    if route == "POST cancellations":
        return {"target_sequence": "1"}
    if route == "POST retirements":
        return {"retry_floor": "2"}
    if route.endswith("/publications"):
        return {"source": world.params["private_mem"], "source_version": "1"}
    return {}


@pytest.mark.parametrize("persona", list(EXPECTED))
def test_authorization_matrix(world, persona):
    failures = []
    params = {**world.params, **world.copies()}
    for route, (method, template) in ROUTES.items():
        path = template.format(**params)
        if method == "GET":
            status, headers, body = world.call(persona, "GET", path)
        else:
            status, headers, body = world.call(persona, "POST", path,
                                               {**world.envelope(persona), **_body_for(world, route)})
        expected = EXPECTED[persona][route]
        want_status, want_code = expected if isinstance(expected, tuple) else (expected, None)
        parsed = _json(body)
        got_code = parsed.get("error", {}).get("code") if isinstance(parsed, dict) and status >= 400 else None
        problems = []
        if (status, got_code) != (want_status, want_code):
            problems.append(f"expected {want_status} {want_code or ''}".rstrip())
        if headers.get("Cache-Control") != "no-store":
            problems.append(f"Cache-Control is {headers.get('Cache-Control')!r}")
        if status == 401 and not (headers.get("WWW-Authenticate") or "").startswith("Bearer"):
            problems.append("401 without a Bearer WWW-Authenticate challenge")
        if status >= 400 and not (isinstance(parsed, dict) and set(parsed) == {"error"}
                                  and isinstance(parsed["error"].get("message"), str)):
            problems.append("error body is not {\"error\": {code, message, ...}}")
        if status == 202 and not headers.get("Location", "").startswith(f"{BASE}/operations/op-"):
            problems.append("202 without a Location of the new operation")
        if problems:
            failures.append(f"{persona} {method} {path} [{route}] -> {status} {body[:300]!r}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


def test_device_rights_are_stored_rights_intersected_with_current_grants(world):
    private = world.params["private"]
    rights = {}
    for persona in ("owner", "reader", "no_write", "no_manage"):
        status, _, body = world.call(persona, "GET", f"/spaces/{private}")
        assert status == 200, (persona, body)
        rights[persona] = json.loads(body)["rights"]
    assert rights == {"owner": ["manage", "read", "write"], "reader": ["read"],
                      "no_write": ["manage", "read"], "no_manage": ["read", "write"]}
    status, _, body = world.call("outsider", "GET", f"/spaces/{world.params['instance']}")
    assert status == 200 and json.loads(body)["rights"] == ["read", "write"]


def test_a_revoked_grant_takes_effect_on_the_next_request(world):
    stack, private = world.stack, world.params["private"]
    own = _created(world.mutate("revokee", "/spaces"))["target"]
    status, _, body = world.call("revokee", "GET", f"/spaces/{own}")
    assert status == 200 and json.loads(body)["rights"] == ["manage", "read", "write"]
    assert world.call("revokee", "GET", f"/spaces/{private}")[0] == 200
    envelope = world.envelope("revokee")

    # the device intersects its stored owner rights with the rewritten grant file at once
    stack.manage("principal", "revoke", "revokee", "--actions", "shared_manage", "--config", str(stack.config))
    status, _, body = world.call("revokee", "GET", f"/spaces/{own}")
    assert status == 200 and json.loads(body)["rights"] == ["read", "write"], body

    stack.manage("principal", "revoke", "revokee", "--actions", "shared_read", "--config", str(stack.config))
    for path in (f"/spaces/{own}", f"/spaces/{private}", "/participant", "/operations"):
        status, headers, body = world.call("revokee", "GET", path)
        assert (status, json.loads(body)["error"]["code"]) == (403, "grant_missing"), (path, body)
        assert headers["Cache-Control"] == "no-store"
    # the other grants still work: a mutation at the next sequence is admitted
    status, _, body = world.call("revokee", "POST", "/spaces", envelope)
    assert status == 202, body

    # revoking the whole principal makes its token unknown
    stack.manage("principal", "revoke", "revokee", "--config", str(stack.config))
    status, headers, body = world.call("revokee", "POST", "/spaces", world.envelope("anonymous"))
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), body
    assert headers["Cache-Control"] == "no-store"


# ---- what a write-only member and a blocked participant are served: their inputs' prompts (seen
# through the receipt's input token count), memory lists and reads, publications (issue 36) ----

def _finished_input(world, persona, conversation, text):
    """The saved terminal receipt of a new input of `persona` (its own receipt: it may read it)."""
    receipt = _created(world.mutate(persona, f"/conversations/{conversation}/inputs", text=text,
                                    model="tiny-llama", max_output_tokens=2))

    def terminal():
        status, _, body = world.call(persona, "GET", f"/operations/{receipt['operation']}")
        assert status == 200, body
        done = json.loads(body)
        return done if done["terminal"]["saved"] else None
    return wait_for(terminal, 60, interval=0.05, what=f"{persona}'s input to end")


def _alone(world, persona, text):
    """The same input in a fresh conversation of a fresh private space of the persona's own: a
    prompt with no earlier turn and nothing to recall."""
    space = _created(world.mutate(persona, "/spaces"))["target"]
    conversation = _created(world.mutate(persona, f"/spaces/{space}/conversations"))["target"]
    return _finished_input(world, persona, conversation, text)


def _memory_objects(world, persona, space):
    status, _, body = world.call(persona, "GET", f"/spaces/{space}/memory")
    assert status == 200, body
    return [row["object"] for row in json.loads(body)["items"]]


def test_a_write_only_members_input_is_prompted_with_nothing_of_the_space_it_cannot_read(world):
    private = world.params["private"]
    # the private space holds the owner's turn and its retained memory; writer may only write there
    conversation = _created(world.mutate("writer", f"/spaces/{private}/conversations"))["target"]
    there = _finished_input(world, "writer", conversation, "Hello.")
    assert there["terminal"]["status"] == "succeeded", there
    assert there["result"]["input_tokens"] == _alone(world, "writer", "Hello.")["result"]["input_tokens"]
    # it cannot read the memory, nor publish it into a room of its own
    status, _, body = world.call("writer", "GET", f"/memory/{world.params['private_mem']}")
    assert (status, json.loads(body)["error"]["code"]) == (404, "memory_not_found")
    room = _created(world.mutate("writer", "/spaces", scope="room"))["target"]
    status, _, body = world.mutate("writer", f"/spaces/{room}/publications",
                                   source=world.params["private_mem"], source_version="1")
    assert (status, json.loads(body)["error"]["code"]) == (404, "memory_not_found"), body


def test_a_zero_rights_row_fences_the_instance_memory_through_every_other_instance_space(world):
    blocked_mem = world.params["instance_mem"]  # retained in the instance space zero is blocked from
    other = world.params["open_instance"]  # an instance space zero may read and write
    conversation = _created(world.mutate("zero", f"/spaces/{other}/conversations"))["target"]
    # another participant shares the instance's memory through any instance space it may read
    assert blocked_mem in _memory_objects(world, "outsider", other)
    # zero neither lists, reads, publishes nor recalls it
    assert blocked_mem not in _memory_objects(world, "zero", other)
    status, _, body = world.call("zero", "GET", f"/memory/{blocked_mem}")
    assert (status, json.loads(body)["error"]["code"]) == (404, "memory_not_found")
    room = _created(world.mutate("zero", "/spaces", scope="room"))["target"]
    status, _, body = world.mutate("zero", f"/spaces/{room}/publications", source=blocked_mem, source_version="1")
    assert (status, json.loads(body)["error"]["code"]) == (404, "memory_not_found"), body
    there = _finished_input(world, "zero", conversation, "Hello.")
    assert there["result"]["input_tokens"] == _alone(world, "zero", "Hello.")["result"]["input_tokens"]


# ---- a memory object its writer changes with write alone, another participant only with manage
# (issue 56): the writer's own input in the instance space, where every registered participant
# holds read+write and the owner manage ----

def _retained_by(world, persona, text):
    """The object `persona`'s new input in the instance space's conversation retained."""
    done = _finished_input(world, persona, world.params["instance_con"], text)
    [obj] = done["memory"]["retained"]
    return obj


def _error_code(result):
    status, _, body = result
    return status, json.loads(body)["error"]["code"]


def _memory_version(world, persona, obj):
    status, _, body = world.call(persona, "GET", f"/memory/{obj}")
    assert status == 200, body
    return json.loads(body)["memory"]["version"]


def test_a_memory_object_is_corrected_by_its_writer_with_write_and_by_another_only_with_manage(world):
    obj = _retained_by(world, "writer", "the writer's fact")
    # outsider and manager hold read+write on the instance space, no manage: not their object
    for persona in ("outsider", "manager"):
        assert _error_code(world.mutate(persona, f"/memory/{obj}/versions", text="not mine",
                                        version="1")) == (403, "right_missing"), persona
    assert _memory_version(world, "writer", obj) == "1"
    corrected = _created(world.mutate("writer", f"/memory/{obj}/versions", text="the writer's corrected fact",
                                      version="1"))
    assert (corrected["kind"], corrected["target"]) == ("memory.version", obj)
    assert _memory_version(world, "outsider", obj) == "2"
    # the owner manages the instance space: it corrects another's object (at its current version)
    assert _error_code(world.mutate("owner", f"/memory/{obj}/versions", text="the owner's fact",
                                    version="1")) == (409, "stale_version")
    assert _created(world.mutate("owner", f"/memory/{obj}/versions", text="the owner's fact",
                                 version="2"))["target"] == obj
    assert _memory_version(world, "writer", obj) == "3"
    # zero, fenced from the instance space, does not see it at all
    assert _error_code(world.mutate("zero", f"/memory/{obj}/versions", text="x", version="3")) == \
        (404, "memory_not_found")


def test_a_memory_object_is_forgotten_by_its_writer_with_write_and_by_another_only_with_manage(world):
    mine, theirs = (_retained_by(world, "writer", text) for text in ("the writer's first", "the writer's second"))
    for persona in ("outsider", "manager"):
        assert _error_code(world.mutate(persona, f"/memory/{mine}/deletion")) == (403, "right_missing"), persona
    assert _error_code(world.mutate("zero", f"/memory/{mine}/deletion")) == (404, "memory_not_found")
    forgotten = _created(world.mutate("writer", f"/memory/{mine}/deletion", reason="mine to forget"))
    assert (forgotten["kind"], forgotten["target"]) == ("memory.delete", mine)
    assert _created(world.mutate("owner", f"/memory/{theirs}/deletion"))["target"] == theirs
    for obj in (mine, theirs):
        for persona in ("writer", "outsider", "owner"):
            assert _error_code(world.call(persona, "GET", f"/memory/{obj}")) == (404, "memory_not_found")
    status, _, body = world.call("owner", "GET", f"/spaces/{world.params['instance']}/memory?limit=200")
    listed = json.loads(body)
    assert status == 200 and listed["next_cursor"] is None, body[:300]
    assert not {mine, theirs} & {row["object"] for row in listed["items"]}
