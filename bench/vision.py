"""Image encode + prefill time per image: the engine beside transformers
(Idefics3ForConditionalGeneration) with its default attention (sdpa) and with its eager one, same
weights, same image and prompt, in one run; the speed-up is over the faster of the two.

    .venv/bin/python bench/vision.py                          # random weights of SmolVLM-256M's shapes
    .venv/bin/python bench/vision.py --checkpoint DIR         # a SmolVLM checkpoint directory you have
    .venv/bin/python bench/vision.py --longest-edge 1024      # images split into 2 x 2 tiles + global
    .venv/bin/python bench/vision.py --tiny                   # the tests' scaled-down shapes: a quick check

Without --checkpoint, a random checkpoint of SmolVLM-256M-Instruct's shapes (reference.SMOLVLM_256M:
SigLIP 768 x 12 layers over 512-pixel tiles of 16-pixel patches, pixel shuffle by 4 to 64 tokens a
tile, SmolLM2 576 x 30 layers) is written with transformers' save_pretrained and packed by `pack
--vlm`'s code. --longest-edge sets the processor's size.longest_edge (SmolVLM's default 2048 makes
every image up to 4 x 4 tiles plus the global view; 512 one tile), written into both.

Per image, each side does all of it: decode the PNG, preprocess (resize, split, normalise), encode
the tiles (vision tower + connector), build the prompt's ids and prefill it to the first token's
logits. Engine: VisionTower.prepare, Tokenizer.encode_chat, submit and one step() (float32, its
default CPU weights). transformers: Idefics3Processor (its Pillow image processor) and one forward
of the model, logits of the last position only, once with attn_implementation="sdpa" (its default)
and once with "eager". The median of --repeats runs each, alternating, so all three meet the same
moments of a shared machine. The first tokens are
compared too.

Then the same through the API (skipped with --no-api): the packed runtime, made shared with the
default embedding model, booted as the service (tests.harness.Stack: `python -m gpu_worker boot
--device cpu` behind `manage.py serve`), and per repeat a new conversation and a new picture (so the
prefix cache holds none of it): `PUT /aotx/v1/media/{sha256}` (upload), then a conversation input
with that image and one output token, from its POST to its saved terminal (input), beside the same
input without the image (text only). The input's figure less the engine's in-process figure is what
the service adds around the model: admission, the header check, memory recall and retention,
journal writes, the helper thread's hop and the polling read (every 20 ms).
"""
import argparse
import io
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTIONS = ("sdpa", "eager")  # transformers' default attention first
sys.path[0] = ROOT  # not bench/: bench/http.py would shadow the standard library's http

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpu_worker.engine import Engine  # noqa: E402
from gpu_worker.engine.reference import SMOLVLM_256M, TINY_VLM, transformers_vlm, write_random_idefics3  # noqa: E402
from gpu_worker.pack import pack_vlm  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402

QUESTION = "Describe this picture in one sentence."


def picture(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(gradient + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def messages() -> list:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def engine_once(engine: Engine, data: bytes, n: int) -> tuple[float, int, int]:
    started = time.perf_counter()
    prepared = engine.vision.prepare(data)  # type: ignore[union-attr]
    ids = engine.tokenizer.encode_chat(messages(), images=[prepared.prompt])
    engine.submit(f"bench-{n}", ids, max_new_tokens=1, images=[prepared])
    [event] = engine.step()
    return time.perf_counter() - started, event[1], len(ids)


@torch.inference_mode()
def transformers_once(model, processor, data: bytes) -> tuple[float, int, int]:
    from PIL import Image
    started = time.perf_counter()
    image = Image.open(io.BytesIO(data)).convert("RGB")
    text = processor.apply_chat_template(messages(), add_generation_prompt=True)
    inputs = processor(text=text, images=[[image]], return_tensors="pt")
    logits = model(**inputs, logits_to_keep=1).logits[0, -1]
    return time.perf_counter() - started, int(logits.argmax()), inputs["input_ids"].shape[1]


def api_timings(runtime: str, width: int, height: int, repeats: int) -> dict[str, list[float]]:
    """Upload and input seconds through the service, with an image and without (see the docstring)."""
    from aotx_client import Client
    from tests.harness import Stack

    with tempfile.TemporaryDirectory() as base:
        stack = Stack(base, runtime)
        stack.ready_seconds = 600
        token = stack.principal("bench")
        stack.boot_device()
        stack.serve()
        times: dict[str, list[float]] = {"upload": [], "input with the image": [], "input, text only": []}
        try:
            with Client(f"http://127.0.0.1:{stack.port}", token, timeout=600) as aotx:
                aotx.register()
                space = aotx.create_space()["target"]
                with RuntimeFile.open(runtime) as served:
                    model = served.json("gen/card")["name"]

                def run_input(media: list) -> float:
                    conversation = aotx.create_conversation(space)["target"]
                    started = time.perf_counter()
                    receipt = aotx.submit_input(conversation, QUESTION, model, max_output_tokens=1, temperature=0,
                                                media=media)
                    while not (aotx.receipt(receipt["operation"]).get("terminal") or {}).get("saved"):
                        time.sleep(0.02)
                    elapsed = time.perf_counter() - started
                    final = aotx.receipt(receipt["operation"])
                    assert final["terminal"]["status"] == "succeeded", final
                    return elapsed

                run_input([])  # warm-up: the first input loads what it loads
                for n in range(repeats):
                    data = picture(width, height, seed=100 + n)
                    started = time.perf_counter()
                    sha = aotx.upload_media(data, "image/png")
                    times["upload"].append(time.perf_counter() - started)
                    times["input with the image"].append(run_input([{"type": "image", "sha256": sha}]))
                    times["input, text only"].append(run_input([]))
        finally:
            stack.stop()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", metavar="DIR", help="a SmolVLM (Idefics3) checkpoint directory")
    parser.add_argument("--longest-edge", type=int, default=512,
                        help="processor size.longest_edge for the random checkpoint (default 512: one tile)")
    parser.add_argument("--image", default="640x480", help="WIDTHxHEIGHT of the test picture")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true", help="the tests' scaled-down random checkpoint (a quick check)")
    parser.add_argument("--no-api", action="store_true", help="skip the end-to-end inputs through the service")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    width, height = (int(v) for v in args.image.split("x"))
    data = picture(width, height)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = os.path.join(tmp, "smolvlm-256m-random")
            started = time.perf_counter()
            shapes = TINY_VLM if args.tiny else SMOLVLM_256M
            write_random_idefics3(checkpoint, {**shapes, "longest_edge": args.longest_edge})
            print(f"random {'tiny' if args.tiny else 'SmolVLM-256M'} checkpoint written in {time.perf_counter() - started:.1f} s", flush=True)
        path = os.path.join(tmp, "vlm.aotxccir")
        pack_vlm(path, checkpoint, with_embedding=False, progress=False)
        from transformers import Idefics3ImageProcessorPil, Idefics3Processor
        processor = Idefics3Processor.from_pretrained(
            checkpoint, image_processor=Idefics3ImageProcessorPil.from_pretrained(checkpoint))
        with RuntimeFile.open(path) as runtime:
            engine = Engine(runtime, prefix_cache=False)
            # transformers' default attention (sdpa) and its eager one: the anchor is the faster
            models = {attention: transformers_vlm(runtime, attn_implementation=attention)
                      for attention in ATTENTIONS}
            ours: list = []
            theirs: dict[str, list] = {attention: [] for attention in ATTENTIONS}
            engine_once(engine, data, -1)  # warm-up, each side
            for model in models.values():
                transformers_once(model, processor, data)
            for n in range(args.repeats):
                ours.append(engine_once(engine, data, n))
                for attention, model in models.items():
                    theirs[attention].append(transformers_once(model, processor, data))
            tiles = engine.vision.prepare(data).tiles  # type: ignore[union-attr]
            del engine, models
        api = None
        if not args.no_api:
            served = os.path.join(tmp, "vlm-shared.aotxccir")
            pack_vlm(served, checkpoint, shared=True, progress=False)
            api = api_timings(served, width, height, args.repeats)
    mid_ours = statistics.median(t for t, _, _ in ours)
    mids = {attention: statistics.median(t for t, _, _ in runs) for attention, runs in theirs.items()}
    same = all(a[1] == b[1] for runs in theirs.values() for a, b in zip(ours, runs))
    print(f"image {width}x{height}: {tiles} tiles, prompt of {ours[0][2]} tokens "
          f"({theirs['sdpa'][0][2]} for transformers); {args.threads} threads; median of {args.repeats}")
    print("| system | encode + prefill per image (s) | first token |")
    print("|---|---:|---:|")
    print(f"| engine | {mid_ours:.3f} | {ours[0][1]} |")
    for attention in ATTENTIONS:
        print(f"| transformers, {attention} attention | {mids[attention]:.3f} | {theirs[attention][0][1]} |")
    best = min(mids, key=mids.__getitem__)
    print(f"speed-up over transformers' faster ({best}): {mids[best] / mid_ours:.2f}x "
          f"(over sdpa, its default, {mids['sdpa'] / mid_ours:.2f}x; over eager {mids['eager'] / mid_ours:.2f}x); "
          f"first tokens equal: {same}")
    if api is not None:
        print(f"\nthrough the API (one output token, a new conversation and picture each; median of {args.repeats}):")
        print("| step | seconds |")
        print("|---|---:|")
        for step, seconds in api.items():
            print(f"| {step} | {statistics.median(seconds):.3f} |")
        added = statistics.median(api["input with the image"]) - mid_ours
        print(f"the service around the engine's encode + prefill: {added:+.3f} s per input with an image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
