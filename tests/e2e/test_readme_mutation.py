"""What a new user pastes, against a real device and gateway (tests/harness.py): README's "whole
mutation by hand" block, run as it stands with bash after `export TOKEN=...` (its address moved to
this stack's port), must register the participant with a 202 receipt, and the same body sent again
must answer that receipt; and the landing page (GET /, aotx_site/urls.py) through the real server,
HEAD included. A block that cannot be pasted (placeholders such as "5c0f…") fails here."""
import json
import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT
from tests.harness import Stack

pytestmark = pytest.mark.e2e
README_URL = "http://127.0.0.1:8000"
MARKER = "A whole mutation by hand"


def readme_block() -> str:
    """The first ```sh block after the paragraph that starts with MARKER, as README has it."""
    text = (ROOT / "README.md").read_text()
    start = text.index(MARKER)
    found = re.search(r"^```sh\n(.*?)^```$", text[start:], re.S | re.M)
    assert found is not None, f"no ```sh block after {MARKER!r} in README.md"
    return found.group(1)


def last_command(block: str) -> str:
    """The block's last command (the POST), with its continuation lines."""
    lines = block.rstrip("\n").split("\n")
    start = max(i for i, line in enumerate(lines) if line.startswith("curl "))
    return "\n".join(lines[start:]) + "\n"


@pytest.fixture(scope="module")
def stack(tiny_runtime, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("readme"), tiny_runtime)
    s.token = s.principal("reader-of-the-readme")
    s.boot_device()
    s.serve()
    yield s
    s.stop()


def run_bash(script: str, stack: Stack) -> str:
    """The script under `bash -eu -o pipefail` (a failing step fails it), with TOKEN exported."""
    out = subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TOKEN=stack.token))
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    return out.stdout


def answer(output: str) -> tuple[int, dict]:
    """The receipt and status the block's POST printed (curl -w '\\nHTTP %{http_code}')."""
    lines = output.rstrip("\n").split("\n")
    status = re.fullmatch(r"HTTP (\d{3})", lines[-1])
    assert status is not None, output
    return int(status.group(1)), json.loads(lines[-2])


@pytest.mark.skipif(shutil.which("curl") is None, reason="README's block uses curl, which is not installed")
def test_the_readme_mutation_by_hand_pastes_into_bash_and_registers_with_a_202_receipt(stack):
    block = readme_block()
    assert README_URL in block  # (a placeholder to fill in by hand would fail the POST below)
    script = block.replace(README_URL, f"http://127.0.0.1:{stack.port}")
    # the block as pasted, then its POST again with the same body: an exact retry
    output = run_bash(script + "echo '--- again'\n" + last_command(script), stack)
    first, again = output.split("--- again\n")
    participant = json.loads(first.split("\n")[0])  # what `echo "$participant"` printed
    assert participant["registered"] is False and participant["next_sequence"] == "1"
    status, receipt = answer(first)
    assert status == 202, first
    assert receipt["participant"] and receipt["admission"]["saved"] is True
    assert receipt["terminal"]["status"] == "succeeded"
    retry_status, retry = answer(again)
    assert retry_status == 200 and retry == receipt
    status, _, body = stack.http("GET", "/aotx/v1/shared/participant", token=stack.token)
    assert status == 200 and json.loads(body)["registered"] is True


def test_the_landing_page_answers_get_and_head_through_the_real_server(stack):
    status, headers, body = stack.http("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert headers["Cache-Control"] == "no-store"
    assert b'href="/admin/"' in body and f"http://127.0.0.1:{stack.port}/aotx/v1/shared/capabilities".encode() in body
    status, headers, body = stack.http("HEAD", "/")
    assert status == 200 and body == b"" and headers["Cache-Control"] == "no-store"
    status, headers, body = stack.http("POST", "/", raw=b"")
    assert status == 405 and headers["Allow"] == "GET, HEAD" and json.loads(body)["error"]["code"] == "method_not_allowed"
