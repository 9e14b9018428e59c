"""A conversation's event stream followed in a real browser: headless Chromium (Debian's, driven by
Playwright) reads the SSE response with fetch and a stream reader — EventSource cannot send a
bearer token — and shows each event in the page as it arrives."""
import json
import shutil

import pytest
from playwright.sync_api import sync_playwright

from tests.e2e.test_streams import mutate, say
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

FOLLOW = """
([path, token]) => {
  window.shown = document.createElement("ul");
  document.body.replaceChildren(window.shown);
  window.following = (async () => {
    const response = await fetch(path, {headers: {Authorization: `Bearer ${token}`}});
    window.httpStatus = response.status;
    window.contentType = response.headers.get("content-type");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const fields = {};
        for (const line of block.split("\\n")) {
          if (line.startsWith(":")) continue;  // a comment: open, keep-alive
          const colon = line.indexOf(":");
          fields[line.slice(0, colon)] = line.slice(colon + 2);
        }
        if (fields.data === undefined) continue;
        const event = JSON.parse(fields.data);
        const item = document.createElement("li");
        item.dataset.id = fields.id;
        item.textContent = `${fields.event} ${event.cursor}: ${event.input.text}`;
        window.shown.append(item);
      }
    }
  })();
}
"""


def test_a_browser_follows_a_conversation_and_shows_each_event_as_it_is_saved(tiny_runtime, tmp_path):
    stack = Stack(tmp_path, tiny_runtime)
    try:
        token = stack.principal("viewer")
        stack.boot_device()
        stack.serve()
        mutate(stack, token, "/participant", {})
        space = mutate(stack, token, "/spaces", {})["target"]
        con = mutate(stack, token, f"/spaces/{space}/conversations", {})["target"]
        say(stack, token, con, "before the page opened")
        path = f"{BASE}/conversations/{con}/events"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{stack.port}/aotx/v1/openapi.json")  # the gateway's origin
                page.evaluate(FOLLOW, [path + "?stream=true", token])
                page.wait_for_function("document.querySelectorAll('li').length === 1", timeout=30_000)
                say(stack, token, con, "while it watched")
                page.wait_for_function("document.querySelectorAll('li').length === 2", timeout=30_000)
                shown = page.eval_on_selector_all("li", "items => items.map(i => [i.dataset.id, i.textContent])")
                assert page.evaluate("window.httpStatus") == 200
                assert page.evaluate("window.contentType").startswith("text/event-stream")
            finally:
                browser.close()
        assert shown == [[f"{path}@1", "event 1: before the page opened"], [f"{path}@2", "event 2: while it watched"]]
        listed = json.loads(stack.http("GET", path, token=token)[2])
        assert [e["input"]["text"] for e in listed["items"]] == ["before the page opened", "while it watched"]
    finally:
        stack.stop()
