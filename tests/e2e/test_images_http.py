"""Images as model input through the real gateway and device, booted on conftest's tiny VLM runtime
(a random scaled-down SmolVLM): a PNG uploaded with `PUT /aotx/v1/media/{sha256}` and attached to a
conversation input, and the same picture sent to Chat Completions as an `image_url` data: part
through the official `openai` package, each answer exactly the engine's own greedy answer for that
image and prompt; bad image bytes refused at admission with the one error body, changing nothing;
an image damaged inside its pixel data admitted and then ended `failed`."""
import base64
import hashlib
import json

import openai
import pytest
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import wait_for
from tests.e2e.test_inputs_http import mutate, new_conversation, writer_space
from tests.engine.test_vision import picture, png
from tests.gpu_worker.kinds.test_input_images import MODEL, damaged_inside
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def stack(tiny_vlm_runtime, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("images"), tiny_vlm_runtime)
    s.token, space = writer_space(s)
    s.conversation = lambda: new_conversation(s, s.token, space)
    yield s
    s.stop()


@torch.inference_mode()
def engine_answer(runtime, data, max_tokens):
    """What the engine itself answers, greedily, to the picture and QUESTION as the only turn."""
    engine = Engine(RuntimeFile.open(runtime), "cpu")
    prepared = engine.vision.prepare(data)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = engine.tokenizer.encode_chat(messages, images=[prepared.prompt])
    [seq] = engine.generate([ids], max_new_tokens=max_tokens, images=[prepared])
    return engine.tokenizer.decode_bytes(t for t in seq.output_ids if t not in seq.stop_token_ids), len(ids)


def put_media(stack, data, kind="image/png"):
    sha = hashlib.sha256(data).hexdigest()
    status, _, body = stack.http("PUT", f"/aotx/v1/media/{sha}", raw=data, token=stack.token,
                                 headers={"Content-Type": kind})
    assert status in (200, 201), body
    return sha


def ended(stack, operation):
    def done():
        out = json.loads(stack.http("GET", f"{BASE}/operations/{operation}", token=stack.token)[2])
        return out if out["terminal"]["saved"] else None
    return wait_for(done, 120, interval=0.05, what=f"operation {operation}'s saved terminal")


def test_an_uploaded_image_reaches_the_model_through_the_api(stack):
    data = png(picture(100, 37, seed=11))
    expected, prompt_tokens = engine_answer(stack.runtime, data, 10)
    conversation = stack.conversation()
    status, receipt = mutate(stack, stack.token, f"/conversations/{conversation}/inputs",
                             {"text": QUESTION, "model": MODEL, "max_output_tokens": 10, "temperature": 0,
                              "media": [{"type": "image", "sha256": put_media(stack, data)}]})
    assert status == 202, receipt
    final = ended(stack, receipt["operation"])
    assert final["terminal"]["status"] == "succeeded", final
    assert int(final["result"]["input_tokens"]) == prompt_tokens
    status, _, body = stack.http("GET", f"{BASE}/operations/{receipt['operation']}/result?offset=0", token=stack.token)
    assert status == 200 and base64.b64decode(json.loads(body)["bytes"]) == expected


def test_an_openai_image_url_part_reaches_the_model(stack):
    data = png(picture(64, 64, seed=12))
    expected, prompt_tokens = engine_answer(stack.runtime, data, 8)
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=stack.token, max_retries=0, timeout=120)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    completion = sdk.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}])
    assert completion.choices[0].message.content == expected.decode("utf-8", errors="replace")
    assert completion.usage.prompt_tokens == prompt_tokens
    with pytest.raises(openai.APIStatusError) as refused:  # not an image: OpenAI's error shape, precise code
        sdk.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert refused.value.status_code == 415 and refused.value.code == "media_not_image"


def test_bad_images_are_refused_at_admission_and_a_damaged_one_fails_its_input(stack):
    conversation = stack.conversation()
    before = json.loads(stack.http("GET", f"{BASE}/participant", token=stack.token)[2])
    whole = png(picture(80, 60, seed=13))
    for data, expected in ((b"GIF89a but nothing after it" * 3, (415, "media_not_image")),
                           (whole[: len(whole) // 2], (400, "media_truncated"))):
        sha = put_media(stack, data)
        status, out = mutate(stack, stack.token, f"/conversations/{conversation}/inputs",
                             {"text": "look", "model": MODEL, "media": [{"type": "image", "sha256": sha}]})
        assert (status, out["error"]["code"]) == expected and out["error"]["sha256"] == sha
    assert json.loads(stack.http("GET", f"{BASE}/participant", token=stack.token)[2]) == before  # nothing changed
    status, receipt = mutate(stack, stack.token, f"/conversations/{conversation}/inputs",
                             {"text": "look", "model": MODEL, "max_output_tokens": 4,
                              "media": [{"type": "image", "sha256": put_media(stack, damaged_inside(whole))}]})
    assert status == 202 and receipt["sequence"] == before["next_sequence"], receipt
    assert ended(stack, receipt["operation"])["terminal"]["status"] == "failed"
