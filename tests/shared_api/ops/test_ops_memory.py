"""The admin console's memory page against the fake device: staff only, linked from the index; a
space's rows through `ops.memory`, paged, with their previews and a "Forget" each; the forget's
confirmation form (a required reason, CSRF protected) and its POST, which sends
`ops.memory.forget` with the staff user's name and shows the receipt, linked; a receipt's page
shows its command bytes (`ops.command`): a staff forget's reason and name."""
import base64
import json
import re

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.shared_api.ops.test_ops_admin import OP, RECEIPTS, receipt

MEMORY = "/admin/ops/memory/"
SPACE = "spc-" + "1" * 32 + "-" + "2" * 32
OBJ = "mem-" + "3" * 32 + "-" + "4" * 32
FORGET = f"{MEMORY}{OBJ}/forget/"


def row(n, text="the meeting is on tuesday", complete=True):
    data = text.encode() if isinstance(text, str) else text
    try:
        shown = data.decode("utf-8")
    except UnicodeDecodeError:
        shown = None
    return {"object": OBJ if n == 1 else f"mem-{n:032x}-{n:032x}", "version": "1", "kind": "source",
            "scope": "room", "published": False, "managed": False, "interpreted": False, "owner": SPACE,
            "room": SPACE, "byte_length": str(len(data) if complete else 300), "source": OP,
            "actor": "par-" + "5" * 32, "published_from": None,
            "preview": {"bytes": base64.b64encode(data).decode(), "text": shown, "complete": complete}}


def forgotten_receipt():
    return {**receipt(1, kind="memory.delete", length=0), "target": OBJ, "participant": "par-" + "6" * 32}


@pytest.mark.parametrize("page", [MEMORY, f"{MEMORY}?space={SPACE}", FORGET])
def test_the_memory_pages_need_a_staff_login(db, ops_device, page):
    response = Client().get(page)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    response = Client().post(FORGET, {"reason": "because"})
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert not ops_device.calls("ops.memory") and not ops_device.calls("ops.memory.forget")


def test_a_user_who_is_not_staff_is_sent_to_the_login(db, ops_device):
    get_user_model().objects.create_user("someone", "", "pw")
    client = Client()
    client.login(username="someone", password="pw")
    assert client.post(FORGET, {"reason": "because"}).status_code == 302
    assert not ops_device.calls("ops.memory.forget")


def test_the_admin_index_links_the_memory_page(staff, ops_device):
    assert f'href="{MEMORY}"' in staff.get("/admin/").content.decode()


def test_the_memory_page_asks_for_a_space_before_it_asks_the_device(staff, ops_device):
    html = staff.get(MEMORY).content.decode()
    assert 'id="aotx-memory-space"' in html and 'id="aotx-memory"' not in html
    response = staff.get(MEMORY, {"space": "spc-nope"})
    assert response.status_code == 200 and response.context["form"].errors
    assert not ops_device.calls("ops.memory")


def test_the_memory_page_lists_the_rows_with_previews_and_pages_with_the_cursor(staff, ops_device):
    ops_device.ops["ops.memory"] = lambda args: (200, {
        "items": [row(1), row(2, b"\xff\xfe"), row(3, "x" * 200, complete=False)],
        "next_cursor": "9" if "cursor" not in args else None})
    response = staff.get(MEMORY, {"space": SPACE})
    assert response.status_code == 200
    assert ops_device.calls("ops.memory") == [{"space": SPACE}]  # limit 50, the default, left out
    html = response.content.decode()
    assert html.count("<tr data-object=") == 3
    assert '<td class="aotx-mono" data-shown-as="text">the meeting is on tuesday</td>' in html
    assert '<td class="aotx-mono" data-shown-as="base64">base64: //4=</td>' in html
    assert f'data-shown-as="text">{"x" * 200} …</td>' in html  # more bytes than the preview
    assert f'href="{FORGET}?space={SPACE}" data-forget="{OBJ}"' in html
    assert "par-" + "5" * 32 in html and "<td>source</td><td>1</td><td>room</td>" in html
    [next_url] = re.findall(r'href="(\?[^"]+)" id="aotx-next"', html)
    page2 = staff.get(MEMORY + next_url.replace("&amp;", "&")).content.decode()
    assert ops_device.calls("ops.memory")[-1] == {"space": SPACE, "cursor": "9"}
    assert 'id="aotx-next"' not in page2 and 'id="aotx-prev"' in page2 and "Page 2." in page2


def test_the_memory_page_says_what_the_device_answered(staff, ops_device):
    ops_device.ops["ops.memory"] = lambda args: (404, {"error": {"code": "space_not_found", "message": "no space"}})
    assert "404 space_not_found: no space" in staff.get(MEMORY, {"space": SPACE}).content.decode()
    ops_device.ops["ops.memory"] = lambda args: (200, {"items": [], "next_cursor": None})
    assert 'id="aotx-no-memory"' in staff.get(MEMORY, {"space": SPACE}).content.decode()


def test_forget_asks_for_a_reason_then_sends_the_staff_users_name_and_links_the_receipt(staff, ops_device):
    page = staff.get(FORGET, {"space": SPACE}).content.decode()
    assert 'id="aotx-forget-form"' in page and "csrfmiddlewaretoken" in page and OBJ in page
    assert not ops_device.calls("ops.memory.forget")  # a GET forgets nothing
    # no reason, a blank one, or one past 256 UTF-8 bytes: refused before the device is asked
    for reason in ("", "   ", "é" * 129):
        response = staff.post(FORGET, {"reason": reason, "space": SPACE})
        assert response.status_code == 200 and response.context["form"].errors["reason"]
        assert 'id="aotx-reason-error"' in response.content.decode()
    assert not ops_device.calls("ops.memory.forget")
    ops_device.ops["ops.memory.forget"] = lambda args: (202, forgotten_receipt())
    response = staff.post(FORGET, {"reason": "the user asked by mail", "space": SPACE})
    assert ops_device.calls("ops.memory.forget") == [{"memory": OBJ, "reason": "the user asked by mail",
                                                      "staff": "root"}]
    html = response.content.decode()
    assert response.status_code == 200 and 'id="aotx-forgotten"' in html and 'id="aotx-forget-form"' not in html
    assert f'href="{RECEIPTS}{OP}/" id="aotx-receipt-link"' in html
    assert f'href="{MEMORY}?space={SPACE}"' in html  # back to the space's memory


def test_a_refused_forget_says_why_and_keeps_the_form(staff, ops_device):
    ops_device.ops["ops.memory.forget"] = lambda args: (404, {"error": {"code": "memory_not_found",
                                                                        "message": "no memory object"}})
    html = staff.post(FORGET, {"reason": "because"}).content.decode()
    assert "404 memory_not_found: no memory object" in html and 'id="aotx-forget-form"' in html
    assert "because</textarea>" in html
    html = staff.post(f"{MEMORY}mem-x/forget/", {"reason": "because"}).content.decode()
    assert "bad_id" in html and len(ops_device.calls("ops.memory.forget")) == 1  # refused before it is sent


def test_forget_is_csrf_protected(db, ops_device):
    get_user_model().objects.create_superuser("root", "", "pw")
    client = Client(enforce_csrf_checks=True)
    client.login(username="root", password="pw")
    assert client.post(FORGET, {"reason": "because"}).status_code == 403
    assert not ops_device.calls("ops.memory.forget")
    ops_device.ops["ops.memory.forget"] = lambda args: (202, forgotten_receipt())
    page = client.get(FORGET).content.decode()
    [token] = re.findall(r'id="aotx-forget-form"><input type="hidden" name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert client.post(FORGET, {"reason": "because", "csrfmiddlewaretoken": token}).status_code == 200
    assert ops_device.calls("ops.memory.forget") == [{"memory": OBJ, "reason": "because", "staff": "root"}]


def test_a_receipts_page_shows_its_command_bytes_with_a_staff_forgets_reason_and_name(staff, ops_device):
    ops_device.ops["ops.receipt"] = lambda args: (200, forgotten_receipt())
    command = json.dumps({"body": {"reason": "the user asked <by mail>", "staff": "root"}, "method": "POST",
                          "path": f"/ops/memory/{OBJ}/deletion"}, separators=(",", ":"))
    ops_device.ops["ops.command"] = lambda args: (200, {
        "operation": args["operation"], "offset": "0", "length": str(len(command)), "next_offset": str(len(command)),
        "bytes": base64.b64encode(command.encode()).decode(), "text": command})
    html = staff.get(f"{RECEIPTS}{OP}/").content.decode()
    assert ops_device.calls("ops.command") == [{"operation": OP}]
    assert '<tr data-field="body.reason"><th scope="row">body.reason</th><td class="aotx-mono">the user asked ' \
           '&lt;by mail&gt;</td></tr>' in html
    assert '<tr data-field="body.staff"><th scope="row">body.staff</th><td class="aotx-mono">root</td></tr>' in html
    assert 'id="aotx-command"' in html
    # a device that cannot say: the receipt still shows, the command section says why
    ops_device.ops.pop("ops.command")
    html = staff.get(f"{RECEIPTS}{OP}/").content.decode()
    assert 'data-field="save.commit_digest"' in html and "400 unknown_command" in html
