"""Images as model input: a SmolVLM (Idefics3) checkpoint packed and run by the engine, against
transformers' Idefics3Processor and Idefics3ForConditionalGeneration holding the same weights.

The checkpoint is random, of SmolVLM's architecture scaled down (reference.TINY_VLM: tiles of 64
pixels, 8x8 patches, 4 image tokens a tile, images split into up to 3x3 tiles plus a global view),
written by transformers' own save_pretrained and packed by `pack --vlm`'s code. Logits are held to
test_model_logits' bound (3e-3 of the logit scale) with the engine's float32 products of the
stored weights (cpu_weights="bf16", float32 keys and values); a missing splice, a wrong patch
order, pixel shuffle or position bucket moves them by order 1.
"""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_worker.engine import Engine
from gpu_worker.engine.engine import EngineRefusal
from gpu_worker.engine.reference import transformers_vlm, write_random_idefics3
from gpu_worker.engine.vision import MediaError, decode_image, image_prompt, preprocess
from gpu_worker.storage.runtime_file import RuntimeFile

from .test_model_logits import assert_logits_close


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "smolvlm-tiny"
    write_random_idefics3(path)
    return path


@pytest.fixture(scope="module")
def vlm(checkpoint, tmp_path_factory):
    from gpu_worker.pack import pack_vlm
    path = tmp_path_factory.mktemp("vlm") / "vlm.aotxccir"
    pack_vlm(path, checkpoint, with_embedding=False, progress=False)
    with RuntimeFile.open(path) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor
    return Idefics3Processor.from_pretrained(checkpoint, image_processor=Idefics3ImageProcessorPil.from_pretrained(
        checkpoint))


def picture(width, height, mode="RGB", seed=0):
    """A random picture (noise over a gradient), so that resampling and every pixel matter."""
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(gradient + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def png(image):
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


SIZES = [(100, 37), (37, 100), (300, 200), (64, 64), (20, 20), (500, 90)]


@pytest.mark.parametrize("width,height", SIZES)
def test_preprocessing_matches_transformers_image_processor(vlm, processor, width, height):
    """Resize, split, rescale and normalise give transformers' pixel values to the bit, and its
    rows and columns of tiles."""
    from gpu_worker.engine.vision import ImageRules
    image = decode_image(png(picture(width, height)))
    ours, rows, cols = preprocess(image, ImageRules.from_card(vlm.json("vision/card")))
    theirs = processor.image_processor(images=[[image]], return_row_col_info=True, return_tensors="np")
    assert (rows, cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ours.shape == theirs["pixel_values"][0].shape and ours.dtype == np.float32
    assert np.array_equal(ours, theirs["pixel_values"][0])


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_other_modes_become_rgb_as_transformers_converts_them(vlm, processor, mode):
    from gpu_worker.engine.vision import ImageRules
    original = picture(90, 70, mode)
    ours, _, _ = preprocess(decode_image(png(original)), ImageRules.from_card(vlm.json("vision/card")))
    theirs = processor.image_processor(images=[[Image.open(io.BytesIO(png(original)))]], return_tensors="np")
    assert np.array_equal(ours, theirs["pixel_values"][0])


def messages(text="What is in this picture?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def prompt_ids(engine, image_bytes, text="What is in this picture?"):
    prepared = engine.vision.prepare(image_bytes)
    return engine.tokenizer.encode_chat(messages(text), images=[prepared.prompt]), prepared


@pytest.mark.parametrize("width,height", [(100, 37), (64, 64)])
def test_prompt_ids_match_the_processor(vlm, processor, width, height):
    engine = Engine(vlm, cpu_weights="bf16")
    data = png(picture(width, height))
    ours, prepared = prompt_ids(engine, data)
    text = processor.apply_chat_template(messages(), add_generation_prompt=True)
    theirs = processor(text=text, images=[[decode_image(data)]], return_tensors="pt")
    assert ours == theirs["input_ids"][0].tolist()
    # one feature row for each image token
    assert prepared.features.shape == (ours.count(engine.image_token_id), engine.card["hidden_size"])


def reference_inputs(processor, data, text="What is in this picture?"):
    prompt = processor.apply_chat_template(messages(text), add_generation_prompt=True)
    return processor(text=prompt, images=[[decode_image(data)]], return_tensors="pt")


@pytest.mark.parametrize("width,height", [(150, 90), (64, 64)])
@torch.inference_mode()
def test_logits_match_transformers_idefics3(vlm, processor, width, height):
    """The prefill's last logits and 12 paged decode steps against Idefics3ForConditionalGeneration
    over the same image and prompt (a 3x2 split plus the global view, and a single tile)."""
    engine = Engine(vlm, cpu_weights="bf16")
    reference = transformers_vlm(vlm)
    data = png(picture(width, height, seed=width))
    ids, prepared = prompt_ids(engine, data)
    inputs = reference_inputs(processor, data)
    assert ids == inputs["input_ids"][0].tolist()
    # the features themselves: the engine's tower against transformers' vision model and connector
    theirs = reference.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output
    assert_logits_close(prepared.features, torch.cat(theirs))
    continuation = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    full = torch.tensor([ids + continuation])
    expected = reference(input_ids=full, pixel_values=inputs["pixel_values"],
                         pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0]
    seq = engine.submit("r", ids, max_new_tokens=100, ignore_eos=True, images=[prepared])
    assert engine.scheduler.admit() == [seq]
    assert len(seq.pages) * engine.page_size >= len(ids)  # image tokens take pages like text
    assert_logits_close(engine.runner.prefill([seq])[0], expected[len(ids) - 1])
    without = Engine(vlm, cpu_weights="bf16")
    [plain] = [without.submit("p", ids, max_new_tokens=1, ignore_eos=True, images=[
        type(prepared)(prepared.prompt, torch.zeros_like(prepared.features), prepared.tiles, "0" * 64)])]
    assert without.scheduler.admit() == [plain]
    gap = (without.runner.prefill([plain])[0] - expected[len(ids) - 1]).abs().max().item()
    assert gap > 0.05 * expected[len(ids) - 1].abs().max().item()  # the features matter: zeros are far off
    for step, token in enumerate(continuation):
        seq.append(token, b"")
        assert_logits_close(engine.runner.decode([seq])[0], expected[len(ids) + step])


@torch.inference_mode()
def test_greedy_tokens_equal_transformers_generate(vlm, processor):
    engine = Engine(vlm, cpu_weights="bf16")
    reference = transformers_vlm(vlm)
    data = png(picture(120, 80, seed=3))
    ids, prepared = prompt_ids(engine, data)
    inputs = reference_inputs(processor, data)
    [seq] = engine.generate([ids], max_new_tokens=24, ignore_eos=True, images=[prepared])
    theirs = reference.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert seq.output_ids == theirs[0, len(ids):].tolist()


@torch.inference_mode()
def test_equal_prompts_with_other_images_share_no_image_pages(vlm):
    """The prefix cache keys pages by tokens; image tokens are the same ids for every image, so pages
    holding them are shared only between requests of equal images (their digests salt the chain)."""
    engine = Engine(vlm, cpu_weights="bf16")
    first, second = png(picture(64, 64, seed=1)), png(picture(64, 64, seed=2))
    ids_a, image_a = prompt_ids(engine, first)
    ids_b, image_b = prompt_ids(engine, second)
    assert ids_a == ids_b
    [a] = engine.generate([ids_a], max_new_tokens=4, images=[image_a])
    [b] = engine.generate([ids_b], max_new_tokens=4, images=[image_b])
    assert b.cached_tokens == 0
    fresh = Engine(vlm, cpu_weights="bf16")
    [alone] = fresh.generate([ids_b], max_new_tokens=4, images=[fresh.vision.prepare(second)])
    assert b.output_ids == alone.output_ids
    [again] = engine.generate([ids_a], max_new_tokens=4, images=[engine.vision.prepare(first)])
    assert again.cached_tokens > 0 and again.output_ids == a.output_ids


def test_image_tokens_and_images_must_agree(vlm):
    engine = Engine(vlm, cpu_weights="bf16")
    ids, prepared = prompt_ids(engine, png(picture(64, 64)))
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("none", ids, max_new_tokens=4)
    assert refused.value.code == "image_tokens_mismatch"
    with pytest.raises(EngineRefusal):
        engine.submit("two", ids, max_new_tokens=4, images=[prepared, prepared])


def test_card_declares_images_and_the_image_token_budget(vlm, processor):
    card = vlm.json("gen/card")
    assert card["capabilities"]["media_types"] == ["image"]
    engine = Engine(vlm, cpu_weights="bf16")
    # the largest split: a wide image resized to 192 x 192 pixels is 3 x 3 tiles plus the global view
    largest = engine.tokenizer.encode(image_prompt(3, 3, 4))
    assert card["capabilities"]["image_token_budget"] == len(largest)
    for width, height in SIZES:
        ids = engine.tokenizer.encode(engine.vision.prepare(png(picture(width, height))).prompt)
        assert len(ids) <= card["capabilities"]["image_token_budget"]


def test_bad_image_bytes_are_refused_precisely():
    with pytest.raises(MediaError) as not_image:
        decode_image(b"this is not an image at all")
    assert (not_image.value.status, not_image.value.code) == (415, "media_not_image")
    whole = png(picture(80, 60))
    with pytest.raises(MediaError) as truncated:
        decode_image(whole[:len(whole) // 2])
    assert (truncated.value.status, truncated.value.code) == (400, "media_truncated")
    # a decompression bomb: a tiny PNG that claims 20000 x 20000 pixels
    bomb = io.BytesIO()
    Image.new("L", (20000, 20000)).save(bomb, format="PNG")
    assert len(bomb.getvalue()) < 1 << 20
    with pytest.raises(MediaError) as bombed:
        decode_image(bomb.getvalue())
    assert (bombed.value.status, bombed.value.code) == (413, "media_too_many_pixels")


def test_pack_command_line_packs_a_checkpoint_and_refuses_other_models(checkpoint, tmp_path, capsys):
    import json
    import shutil

    from gpu_worker.pack import main
    out = tmp_path / "vlm.aotxccir"
    assert main(["--runtime", str(out), "--vlm", str(checkpoint)]) == 0
    with RuntimeFile.open(out) as runtime:
        assert runtime.json("gen/card")["capabilities"]["media_types"] == ["image"]
        assert runtime.has("vision/card") and runtime.has("emb/card")
    other = tmp_path / "not-a-vlm"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    assert main(["--runtime", str(tmp_path / "x.aotxccir"), "--vlm", str(other)]) == 2
    assert "is not idefics3" in capsys.readouterr().err
    assert not (tmp_path / "x.aotxccir").exists()
