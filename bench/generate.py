"""Generation tokens/s of the engine beside transformers, same weights and same prompts, in one run.

    .venv/bin/python bench/generate.py                      # CPU, SmolLM2-135M-Instruct, 1 and 8 requests
    .venv/bin/python bench/generate.py --llama-batched-bench PATH   # ... beside llama.cpp on the same GGUF
    .venv/bin/python bench/generate.py --device cuda --random-weights   # GPU: 1, 64, 256 requests

Every request gets the same number of prompt tokens and generates exactly --new-tokens greedily
(end-of-sequence does not stop either side), so every system does the same work. Columns:

- engine: all requests submitted at once, then `step()` until done (one batched decode per step);
  its prefix cache is off, so a repeated run prefills its prompts again, as llama-batched-bench does.
  On CPU the engine keeps the GGUF's own quantized blocks (cpu_weights "quantized", the default).
- engine bf16 (CPU, `--bf16`, default on): the same engine on the runtime file's bfloat16 weights
  (cpu_weights "bf16"), to show what the quantized blocks bring.
- llama.cpp (`--llama-batched-bench PATH`): `llama-batched-bench` on the GGUF the default runtime was
  packed from, the same prompt and new-token counts, one sequence per request, as many threads as
  the engine; its rate here is generated tokens over its whole time (prompt processing included),
  the engine's measure (its own S t/s column also counts the prompt tokens).
- engine, PyTorch ops (CUDA, `--plain`): the same engine without its Triton kernels (triton_ops),
  to show what they bring.
- hf batch: transformers `generate` on one batch of all the prompts (equal lengths, so no padding).
- hf 1-by-1: transformers `generate` serving the requests one after another, as a server without
  batching would; its rate does not depend on the count, so it is the 1-request rate.
- hf paged: transformers' continuous-batching `generate_batch` (default on CUDA, `--paged` on CPU),
  including the set-up each call does (sizing its cache, capturing graphs), on a model instance
  of its own (the same weights).

Rates include prefill. Each system is warmed up once first, and on CUDA once more at each request
count (the engine captures that size's CUDA graphs then, as a server does once in its life;
generate_batch is timed as it is); then engine and hf batch run in turn --repeats times (default 2
on CPU, 1 on CUDA) and the best run of each counts, so both meet the same moments of a shared
machine whose speed drifts. Both sides compute in float32 on CPU
and bfloat16 on CUDA. The engine's greedy tokens are checked against transformers' batch output.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

import torch  # noqa: E402

from bench.build_info import describe  # noqa: E402
from gpu_worker import pack
from gpu_worker.storage import runtime_file_writer  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from gpu_worker.engine.reference import transformers_model  # noqa: E402
from gpu_worker.storage.runtime_file import DEFAULT_RUNTIME_PROFILE, RuntimeFile  # noqa: E402

DEFAULT_RUNTIME = ROOT / "var" / "identity.aotxccir"
QUESTIONS = [
    "Tell me about the history of the printing press and how it changed the spread of knowledge in Europe.",
    "Explain how a refrigerator works, step by step, for someone who has never studied physics at all.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night.",
    "What are the main differences between a comet and an asteroid, and where in the solar system are they found?",
    "Describe a good weekly routine for someone learning to play the piano as an adult beginner.",
    "Why do leaves change colour in autumn? Please explain the chemistry in simple words for a child.",
    "Give me advice on planning a two-week trip through Japan by train, including which cities to visit.",
    "How do vaccines train the immune system, and why are some given as several doses over time?",
]
SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                 "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, run):
    synchronize(device)
    start = time.perf_counter()
    result = run()
    synchronize(device)
    return time.perf_counter() - start, result


# ---- runtime files --------------------------------------------------------------------------------

def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE of the model's vocabulary size (specials, 256 bytes, then byte pairs), so every
    id the random model emits has bytes."""
    specials = pack.TINY_SPECIAL_TOKENS
    alphabet = list(pack._bytes_to_unicode().values())
    pairs = [(a, b) for a in alphabet for b in alphabet][:vocab_size - len(specials) - len(alphabet)]
    tokens = specials + alphabet + [a + b for a, b in pairs]
    types = [pack.TOKEN_TYPE_CONTROL] * len(specials) + [1] * (len(tokens) - len(specials))
    return pack.byte_level_tokenizer(tokens, pairs, types, "smollm")


def random_weights_runtime(path, kv_pages: int, seed: int = 0):
    """A SmolLM2-135M-shaped runtime with random bfloat16 weights (the GPU machine has no model files)."""
    c, g = SMOLLM2_SHAPE, torch.Generator().manual_seed(seed)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_heads"] * d, c["num_kv_heads"] * d

    def weight(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def components():
        yield "runtime_profile", "json", {**DEFAULT_RUNTIME_PROFILE, "kv_pages": kv_pages}
        yield "gen/card", "json", {"name": "random-smollm2-135m", "architecture": "llama", **c,
                                   "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                                   "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                                   "capabilities": dict(pack.NO_CAPABILITIES), "source": {"random_seed": seed}}
        yield "gen/tokenizer", "json", synthetic_tokenizer(c["vocab_size"]).to_str()
        yield "gen/chat_template", "text", pack.CHATML_TEMPLATE
        yield "gen/tensor/embed_tokens", "tensor", weight(c["vocab_size"], h)
        yield "gen/tensor/norm", "tensor", torch.ones(h, dtype=torch.bfloat16)
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                  "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        for n in range(c["num_layers"]):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                yield f"gen/tensor/layers.{n}.{norm}", "tensor", torch.ones(h, dtype=torch.bfloat16)
            for key, shape in shapes.items():
                yield f"gen/tensor/layers.{n}.{key}", "tensor", weight(*shape)

    runtime_file_writer.create(path, components())


def open_runtime(args, workdir, most_requests):
    if args.random_weights:
        path = os.path.join(workdir, "random.aotxccir")
        pages = most_requests * -(-(args.prompt_tokens + args.new_tokens) // DEFAULT_RUNTIME_PROFILE["page_size"])
        random_weights_runtime(path, kv_pages=max(pages, DEFAULT_RUNTIME_PROFILE["page_grant"]))
    elif args.runtime:
        path = args.runtime
    elif DEFAULT_RUNTIME.exists():
        path = str(DEFAULT_RUNTIME)
    else:
        path = os.path.join(workdir, "default.aotxccir")
        print(f"packing the default runtime into {path} ...", file=sys.stderr)
        pack.pack_default(path, progress=False)
    return RuntimeFile.open(path)


def make_prompts(engine, count, length, random_ids):
    if random_ids:
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, engine.card["vocab_size"], (count, length), generator=g).tolist()
    prompts = []
    for n in range(count):
        question = QUESTIONS[n % len(QUESTIONS)]
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": " ".join([question] * 4)}])
        # The chat prompt's last `length` tokens: it still ends with the assistant turn's header.
        prompts.append(ids[-length:])
    return prompts


# ---- the systems ----------------------------------------------------------------------------------

def run_engine(engine, prompts, new_tokens):
    return [seq.output_ids for seq in engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)]


def run_hf_batch(model, prompts, new_tokens, device):
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def run_hf_paged(model, prompts, new_tokens):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=config)
    return [result.generated_tokens for result in results.values()]


def run_llama_batched_bench(binary: str, gguf: str, count: int, prompt_tokens: int, new_tokens: int,
                            threads: int) -> float:
    """Seconds llama-batched-bench takes for `count` parallel sequences, prompt processing included."""
    context = count * (prompt_tokens + new_tokens) + 64
    out = subprocess.run([binary, "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(count),
                          "-t", str(threads)], capture_output=True, text=True, check=True, timeout=900).stdout
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == count:
            return float(cells[8])
    raise RuntimeError(f"no result row in llama-batched-bench's output:\n{out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runtime", help=f"runtime file (default {DEFAULT_RUNTIME}, packed if missing)")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M-shaped random weights and random prompt ids (no model files needed)")
    parser.add_argument("--requests", help="comma-separated request counts (default 1,8 on CPU; 1,64,256 on CUDA)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 64 on CPU, 128 on CUDA)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, help="alternating runs of engine and hf batch, best of each "
                                                    "(default 2 on CPU, 1 on CUDA)")
    parser.add_argument("--paged", action=argparse.BooleanOptionalAction,
                        help="also time transformers generate_batch (default: on CUDA only)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                        help="also time the engine on the bfloat16 weights (default: on CPU only)")
    parser.add_argument("--llama-batched-bench", metavar="PATH",
                        help="llama.cpp's llama-batched-bench binary: time it on the same GGUF (CPU, default runtime)")
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction,
                        help="also time the engine without its Triton kernels (default: on CUDA only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    counts = [int(n) for n in (args.requests or ("1,64,256" if device.type == "cuda" else "1,8")).split(",")]
    args.prompt_tokens = args.prompt_tokens or (128 if device.type == "cuda" else 64)
    repeats = args.repeats or (1 if device.type == "cuda" else 2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    with tempfile.TemporaryDirectory() as workdir:
        runtime = open_runtime(args, workdir, max(counts))
        engine = Engine(runtime, device=args.device, prefix_cache=False)
        plain = bf16 = None
        if args.plain if args.plain is not None else device.type == "cuda":
            plain = Engine(runtime, device=args.device, fused_kernels=False, prefix_cache=False)
        if args.bf16 if args.bf16 is not None else device.type == "cpu":
            bf16 = Engine(runtime, device=args.device, cpu_weights="bf16", prefix_cache=False)
        gguf = None
        if args.llama_batched_bench:
            print(f"llama.cpp: {describe(args.llama_batched_bench)}", flush=True)
            if args.random_weights or args.runtime or device.type != "cpu":
                parser.error("--llama-batched-bench compares on the CPU with the default runtime's GGUF")
            module, distribution, filename = pack.DEFAULT_GGUF
            gguf = str(pack._package_dir(module, distribution) / filename)
        reference = transformers_model(runtime, dtype=dtype, device=device)
        reference.generation_config.eos_token_id = None  # generate exactly --new-tokens, as the engine does
        # generate_batch gets a model of its own: some transformers releases (5.17, the GPU machine's)
        # leave a model switched to paged attention after it, and plain generate then fails on it.
        paged_model = None
        if args.paged if args.paged is not None else device.type == "cuda":
            paged_model = transformers_model(runtime, dtype=dtype, device=device)
        kernels = "cpu_ops" if engine.model.cpu_ops else "triton_ops" if engine.model.fused else "PyTorch's"
        print(f"model {engine.card['name']} on {device} ({dtype}), {torch.get_num_threads()} CPU threads, "
              f"{args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens per request, "
              f"engine on {kernels} operators", flush=True)

        prompts = make_prompts(engine, max(counts), args.prompt_tokens, args.random_weights)
        engines = tuple(e for e in (engine, plain, bf16) if e is not None)
        for warm in engines:
            run_engine(warm, prompts[:2], 4)  # warm-up (CUDA: first graphs captured, kernels chosen)
        run_hf_batch(reference, prompts[:2], 4, device)
        rows = []
        for count in counts:
            batch = prompts[:count]
            tokens = count * args.new_tokens
            if device.type == "cuda":  # this size's graphs (batch and page buckets) and kernels, untimed
                for warm in engines:
                    run_engine(warm, batch, args.new_tokens)
                run_hf_batch(reference, batch, 4, device)
            ours_s = hf_s = plain_s = bf16_s = llama_s = float("inf")
            for _ in range(repeats):
                seconds, ours = timed(device, lambda: run_engine(engine, batch, args.new_tokens))
                ours_s = min(ours_s, seconds)
                if plain:
                    plain_s = min(plain_s, timed(device, lambda: run_engine(plain, batch, args.new_tokens))[0])
                if bf16:
                    bf16_s = min(bf16_s, timed(device, lambda: run_engine(bf16, batch, args.new_tokens))[0])
                if gguf:
                    llama_s = min(llama_s, run_llama_batched_bench(args.llama_batched_bench, gguf, count,
                                                                   args.prompt_tokens, args.new_tokens,
                                                                   torch.get_num_threads()))
                seconds, theirs = timed(device, lambda: run_hf_batch(reference, batch, args.new_tokens, device))
                hf_s = min(hf_s, seconds)
            same = sum(a == b for a, b in zip(ours, theirs))
            paged = None
            if paged_model is not None:
                try:
                    paged_s, _ = timed(device, lambda: run_hf_paged(paged_model, batch, args.new_tokens))
                    paged = tokens / paged_s
                except Exception as exc:  # an optional baseline: report it, keep the table
                    print(f"hf paged generate_batch unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            rows.append((count, tokens / ours_s, tokens / hf_s, paged, same, tokens / llama_s if gguf else None))
            if bf16:
                print(f"  {count} requests: engine on bfloat16 weights {tokens / bf16_s:.1f} tok/s "
                      f"(quantized blocks {bf16_s / ours_s:.2f}x faster)", flush=True)
            if gguf:
                print(f"  {count} requests: llama.cpp llama-batched-bench {tokens / llama_s:.1f} tok/s "
                      f"(engine {llama_s / ours_s:.2f}x llama.cpp's rate)", flush=True)
            if plain:
                print(f"  {count} requests: engine on PyTorch's operators {tokens / plain_s:.1f} tok/s "
                      f"(triton_ops {plain_s / ours_s:.2f}x faster)", flush=True)
            print(f"  {count} requests: engine {tokens / ours_s:.1f} tok/s, hf batch {tokens / hf_s:.1f} tok/s, "
                  f"identical greedy outputs {same}/{count}", flush=True)

    one_by_one = next((row[2] for row in rows if row[0] == 1), None)
    print()
    print(f"{'requests':>8} | {'engine':>9} | {'hf batch':>9} | {'hf 1-by-1':>9} | {'hf paged':>9} | "
          f"{'llama.cpp':>9} | {'vs batch':>8} | {'vs 1-by-1':>9} | {'vs llama':>8} | same tokens")
    for count, ours, hf, paged, same, llama in rows:
        sequential = f"{one_by_one:9.1f}" if one_by_one else f"{'-':>9}"
        versus_sequential = f"{ours / one_by_one:8.2f}x" if one_by_one else f"{'-':>9}"
        paged_text = f"{paged:9.1f}" if paged else f"{'-':>9}"
        llama_text, versus_llama = (f"{llama:9.1f}", f"{ours / llama:7.2f}x") if llama else (f"{'-':>9}", f"{'-':>8}")
        print(f"{count:>8} | {ours:9.1f} | {hf:9.1f} | {sequential} | {paged_text} | {llama_text} | {ours / hf:7.2f}x | "
              f"{versus_sequential} | {versus_llama} | {same}/{count}")
    print("(tokens/s, prefill included; hf 1-by-1 = the 1-request rate of transformers generate)")


if __name__ == "__main__":
    main()
