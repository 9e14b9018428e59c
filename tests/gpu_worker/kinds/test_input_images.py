"""Images as input through the device (gpu_worker/images.py): a runtime packed from a random
scaled-down SmolVLM checkpoint (conftest.tiny_vlm_runtime), an input with an uploaded image run
end to end against the engine's own answer for the same image and prompt, the precise refusals of
bad image bytes at admission (nothing changes), and image tokens charged against the page limit."""
import base64
import hashlib
import io

import pytest
import torch
from PIL import Image

from gpu_worker.pipeline import execution
from gpu_worker.engine.engine import Engine
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.engine.test_vision import picture, png
from tests.gpu_worker.kinds.test_inputs import EngineWorld, running
from tests.gpu_worker.kinds.test_shared_state import code

MODEL = "smolvlm-tiny"  # conftest.tiny_vlm_runtime's model


@pytest.fixture
def world(tiny_vlm_runtime, tmp_path):
    with running(EngineWorld(tiny_vlm_runtime, tmp_path, ["a", "b"])) as w:
        yield w


def upload(world, name, data):
    sha = hashlib.sha256(data).hexdigest()
    status, _ = world.read(name, "media.put", sha256=sha, data=data, type="image")
    assert status == 201
    return sha


def say(world, conversation, text, media, **fields):
    return world.mutate("a", "conversations.input", f"/conversations/{conversation}/inputs",
                        {"text": text, "model": MODEL, "media": media, **fields},
                        extra={"conversation": conversation})


def card(world):
    return world.device.runtime.json("gen/card")


@torch.inference_mode()
def test_an_input_with_an_image_answers_what_the_engine_gives_for_that_image_and_prompt(world, monkeypatch):
    submitted = []
    runner_submit = world.device.runner.submit

    def recording(request_id, ids, **settings):
        submitted.append((ids, settings.get("images")))
        runner_submit(request_id, ids, **settings)

    monkeypatch.setattr(world.device.runner, "submit", recording)
    _, conversation = world.conversation("a")
    data = png(picture(100, 37, seed=5))
    sha = upload(world, "a", data)
    status, receipt = say(world, conversation, "What is in this picture?", [{"type": "image", "sha256": sha}],
                          max_output_tokens=12, temperature=0)
    assert status == 202, receipt
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "succeeded", done
    answer = base64.b64decode(world.read("a", "operations.result", operation=receipt["operation"])[1]["bytes"])

    # the engine directly, for the same image and prompt
    engine = Engine(RuntimeFile.open(world.runtime), "cpu")
    prepared = engine.vision.prepare(data)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    ids = engine.tokenizer.encode_chat(messages, images=[prepared.prompt])
    [(device_ids, device_images)] = submitted
    assert device_ids == ids and int(done["result"]["input_tokens"]) == len(ids)
    assert ids.count(engine.image_token_id) == prepared.features.shape[0] > 0
    [image] = device_images
    assert image.digest == sha and torch.equal(image.features, prepared.features)
    [seq] = engine.generate([ids], max_new_tokens=12, images=[prepared])
    assert int(done["result"]["output_tokens"]) == len(seq.output_ids)
    assert answer == engine.tokenizer.decode_bytes(t for t in seq.output_ids if t not in seq.stop_token_ids)
    # the prefill's logits: the features matter (the prompt without them answers otherwise)
    assert seq.output_ids != engine.generate([ids], max_new_tokens=12, images=[type(prepared)(
        prepared.prompt, torch.zeros_like(prepared.features), prepared.tiles, "0" * 64)])[0].output_ids


def test_bad_image_bytes_are_refused_precisely_and_change_nothing(world):
    _, conversation = world.conversation("a")
    whole = png(picture(80, 60))
    big = io.BytesIO()
    Image.new("L", (5000, 4000)).save(big, format="PNG")  # a small file of 20 million pixels
    jpeg = io.BytesIO()
    picture(80, 60).save(jpeg, format="JPEG")
    bad = {
        "text": (b"hello, these are not the bytes of an image" * 4, (415, "media_not_image")),
        "truncated png": (whole[: len(whole) // 2], (400, "media_truncated")),
        "truncated jpeg": (jpeg.getvalue()[:-200], (400, "media_truncated")),
        "bomb": (big.getvalue(), (413, "media_too_many_pixels")),
    }
    before = world.read("a", "participant.get")[1]
    for name, (data, expected) in bad.items():
        sha = upload(world, "a", data)
        status, body = say(world, conversation, "look", [{"type": "image", "sha256": sha}])
        assert (status, body["error"]["code"]) == expected, name
        assert body["error"]["sha256"] == sha
    # audio on an image-only model
    audio = hashlib.sha256(b"RIFF audio").hexdigest()
    assert world.read("a", "media.put", sha256=audio, data=b"RIFF audio", type="audio")[0] == 201
    assert code(say(world, conversation, "hear", [{"type": "audio", "sha256": audio}])) == (409, "model_lacks_media")
    # a source the participant does not own
    other = upload(world, "b", png(picture(30, 30)))
    assert code(say(world, conversation, "look", [{"type": "image", "sha256": other}])) == (404, "media_not_found")
    after = world.read("a", "participant.get")[1]
    assert after == before  # no sequence taken, no quota counted
    assert not world.device.executions.live and not len(world.device.executions.to_lease)
    # a good image still goes through with the very next sequence
    sha = upload(world, "a", whole)
    status, receipt = say(world, conversation, "look", [{"type": "image", "sha256": sha}], max_output_tokens=2)
    assert status == 202 and receipt["sequence"] == before["next_sequence"]
    world.pump(world.finished("a", receipt["operation"]))


def damaged_inside(data):
    """A PNG whose header, size and end marker are whole but whose pixel data is damaged: the
    admission's header and tail check passes it, only full decoding finds the damage."""
    at = data.index(b"IDAT") + 4 + 20
    return data[:at] + bytes(b ^ 0x5A for b in data[at:at + 32]) + data[at + 32:]


def test_an_image_damaged_inside_fails_its_input_on_the_helper_thread_and_the_next_input_runs(world, monkeypatch):
    """Admitted (the checks at admission read no pixel), then the decoding on the helper thread
    fails: the input ends `failed` with a saved terminal, nothing reaches the engine, its pages are
    given back, and the next input of the conversation runs."""
    submitted = []
    runner_submit = world.device.runner.submit

    def recording(request_id, ids, **settings):
        submitted.append(request_id)
        runner_submit(request_id, ids, **settings)

    monkeypatch.setattr(world.device.runner, "submit", recording)
    _, conversation = world.conversation("a")
    whole = png(picture(80, 60, seed=7))
    bad = damaged_inside(whole)
    from gpu_worker.engine.vision import MediaError, decode_image
    with pytest.raises(MediaError):
        decode_image(bad)
    sha = upload(world, "a", bad)
    status, receipt = say(world, conversation, "look", [{"type": "image", "sha256": sha}], max_output_tokens=4)
    assert status == 202, receipt
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "failed" and done["terminal"]["saved"], done
    assert done["result"]["output_tokens"] in (None, "0") and submitted == []
    assert not world.device.executions.live
    pool = world.device.runner.engine.pool
    assert (pool.owned, pool.pending, pool.running, pool.waiting) == (0, 0, 0, 0)
    status, receipt = say(world, conversation, "look again", [{"type": "image", "sha256": upload(world, "a", whole)}],
                          max_output_tokens=2)
    assert status == 202, receipt
    world.pump(world.finished("a", receipt["operation"]))
    assert world.read("a", "operations.get", operation=receipt["operation"])[1]["terminal"]["status"] == "succeeded"
    assert len(submitted) == 1


def test_image_tokens_count_in_the_page_limit(world):
    _, conversation = world.conversation("a")
    budget = card(world)["capabilities"]["image_token_budget"]
    page_size = world.device.runtime.runtime_profile["page_size"]
    sha = upload(world, "a", png(picture(64, 64)))
    row = {"type": "image", "sha256": sha}
    pages = -(-(budget + 1) // page_size)  # room for one image and one output token
    assert code(say(world, conversation, "look", [row, row], pages=pages, max_output_tokens=1)) == \
        (409, "images_exceed_page_limit")
    output = pages * page_size - budget
    assert code(say(world, conversation, "look", [row], pages=pages, max_output_tokens=output + 1)) == \
        (409, "images_exceed_page_limit")
    assert say(world, conversation, "look", [row], pages=pages, max_output_tokens=output)[0] == 202  # admitted
    # the text and the chat template count when the prompt is built (as for text): with room for them, it runs
    pages += 4
    status, receipt = say(world, conversation, "look", [row], pages=pages,
                          max_output_tokens=pages * page_size - budget - 4 * page_size)
    assert status == 202, receipt
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "succeeded", done
    assert int(done["result"]["input_tokens"]) <= pages * page_size - int(receipt["effective"]["max_output_tokens"])


def test_media_of_earlier_turns_stay_text_links_and_never_attach_again(world, monkeypatch):
    submitted = []
    runner_submit = world.device.runner.submit

    def recording(request_id, ids, **settings):
        submitted.append(settings.get("images"))
        runner_submit(request_id, ids, **settings)

    monkeypatch.setattr(world.device.runner, "submit", recording)
    _, conversation = world.conversation("a")
    sha = upload(world, "a", png(picture(64, 64)))
    status, first = say(world, conversation, "look", [{"type": "image", "sha256": sha}], max_output_tokens=2)
    world.pump(world.finished("a", first["operation"]))
    status, second = say(world, conversation, "and now?", [], max_output_tokens=2)
    assert status == 202
    world.pump(world.finished("a", second["operation"]))
    assert [len(images or ()) for images in submitted] == [1, 0]
    inputs = world.device.state.conversations.inputs
    [rrows] = [rows for rows in inputs if rows]
    turns = execution.conversation_turns(world.device, rrows[-1])
    assert f"media://{sha}" in turns[0]["content"]  # the earlier input's image, as text


def test_forgetting_a_source_takes_the_media_only_it_names_and_its_bytes_leave_at_the_checkpoint(world):
    """Issue 56: a forgotten source's payload links its input's images; a source only its actor
    uploaded, and that nothing else names, goes with it: the state no longer lists it, and after the
    next checkpoint its file and its bytes are nowhere in the runtime file or the journal
    directory. Another participant's upload that a text merely names stays."""
    from tests.gpu_worker.kinds.test_memory_deletions import forget, stored_bytes
    _, conversation = world.conversation("a")
    image = png(picture(48, 40))
    sha = upload(world, "a", image)
    theirs = upload(world, "b", png(picture(40, 48)))
    status, receipt = say(world, conversation, f"look, and media://{theirs}", [{"type": "image", "sha256": sha}],
                          max_output_tokens=2)
    assert status == 202
    world.pump(world.finished("a", receipt["operation"]))
    [obj] = world.read("a", "operations.get", operation=receipt["operation"])[1]["memory"]["retained"]
    assert world.device.checkpoint() is not None  # the image's bytes are in the runtime file now
    assert image in stored_bytes(world)
    assert forget(world, "a", obj)[0] == 202
    assert sha not in world.device.state.media and theirs in world.device.state.media
    assert world.device.checkpoint() is not None
    assert image not in stored_bytes(world)
    assert code(say(world, conversation, "again", [{"type": "image", "sha256": sha}])) == (404, "media_not_found")
