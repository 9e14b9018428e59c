"""Image parts of an ordinary chat at the device (kinds/chat.py, `chat.completions` with `images`): on
the tiny VLM (conftest's tiny_vlm_runtime) the answer is exactly the
engine's own greedy answer for the same image and prompt; a text-only model refuses images
(`model_lacks_media`); bytes that are no image, or a truncated one, are refused precisely before
anything is tokenized or submitted."""
import collections
import json

import pytest
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.engine.test_vision import picture, png
from tests.gpu_worker.kinds.test_input_images import MODEL
from tests.gpu_worker.kinds.test_inputs import EngineWorld, running

QUESTION = "What is in this picture?"


def image_chat(model, data, **fields):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return {"model": model, "messages": messages, "images": [data], "max_tokens": 8, "temperature": 0.0,
            "stream": False, **fields}


def send_chat(world, args):
    """Sends `chat.completions`; its frames as they come (a refusal is the first and last)."""
    req_id = next(world.ids)
    inbox = collections.deque([("c", {"v": 1, "id": req_id, "op": "chat.completions",
                                      "principal": world.principals["a"], "args": args})])
    frames = []

    def collect():
        replies = world.device.committer.run_sync(collections.deque()) + world.device.take_outbox() + world.pushed
        world.pushed = []
        frames.extend(m for _, m in replies if m.id == req_id)
        return any(not f.more for f in frames)

    frames.extend(m for _, m in world.device.committer.run_sync(inbox) + world.device.take_outbox()
                  if m.id == req_id)
    return frames, collect


def refusal(frames):
    [frame] = frames
    return frame.status, json.loads(frame.body)["error"]["code"]


@pytest.fixture
def vlm_world(tiny_vlm_runtime, tmp_path):
    with running(EngineWorld(tiny_vlm_runtime, tmp_path, ["a"])) as w:
        yield w


@pytest.fixture
def text_world(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000})
    with running(EngineWorld(path, tmp_path, ["a"])) as w:
        yield w


@torch.inference_mode()
def test_a_chat_with_an_image_answers_exactly_what_the_engine_gives_for_that_image_and_prompt(vlm_world):
    data = png(picture(100, 37, seed=7))
    frames, collect = send_chat(vlm_world, image_chat(MODEL, data))
    vlm_world.pump(collect)
    assert frames[0].event == "accepted"
    final = frames[-1]
    assert final.status == 200, final
    body = json.loads(final.body)

    engine = Engine(RuntimeFile.open(vlm_world.runtime), "cpu")
    prepared = engine.vision.prepare(data)
    ids = engine.tokenizer.encode_chat(image_chat(MODEL, data)["messages"], images=[prepared.prompt])
    assert ids.count(engine.image_token_id) == prepared.features.shape[0] > 0
    assert body["prompt_tokens"] == len(ids)
    [seq] = engine.generate([ids], max_new_tokens=8, images=[prepared])
    assert body["completion_tokens"] == len(seq.output_ids)
    assert body["text"] == engine.tokenizer.decode_bytes(
        t for t in seq.output_ids if t not in seq.stop_token_ids).decode("utf-8", "replace")
    assert vlm_world.device.runner.engine.pool.owned == 0  # its pages freed


def test_bad_image_bytes_are_refused_precisely_before_anything_runs(vlm_world):
    whole = png(picture(80, 60))
    submitted = []
    vlm_world.device.runner.submit = lambda *a, **k: submitted.append(a)
    bad = {
        "text": (b"hello, these are not the bytes of an image" * 4, (415, "media_not_image")),
        "truncated png": (whole[: len(whole) // 2], (400, "media_truncated")),
    }
    for name, (data, expected) in bad.items():
        frames, _ = send_chat(vlm_world, image_chat(MODEL, data))
        assert refusal(frames) == expected, name
    # an image part without its bytes, or bytes without a part
    args = image_chat(MODEL, whole)
    assert refusal(send_chat(vlm_world, {**args, "images": []})[0]) == (400, "invalid_messages")
    assert refusal(send_chat(vlm_world, {**args, "images": [whole, whole]})[0]) == (400, "invalid_messages")
    assert submitted == []


def test_a_text_only_model_refuses_an_image(text_world):
    frames, _ = send_chat(text_world, image_chat("tiny-llama", png(picture(30, 30))))
    status, code = refusal(frames)
    assert (status, code) == (400, "model_lacks_media")
    assert "does not take images" in json.loads(frames[0].body)["error"]["message"]
