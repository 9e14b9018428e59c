"""Recall and embedding against the libraries a team would pick instead, in one run:

    .venv/bin/python bench/recall.py [--rows 10000,100000] [--queries 200] [--visible 0.02,0.5]
                                     [--texts 512] [--rounds 3]

1. Recall: one query's exact top-10 over a table of --rows random normalised 384-dim float32
   vectors owned by 200 memory owners, restricted to the rows whose owner is visible to the caller
   (a share --visible of the owners). Ours: gpu_worker.memory.recall (torch; the row mask is
   gathered from the caller's owner table on each call). FAISS: `IndexFlatIP` (faiss-cpu) holding
   the same vectors, searched with an `IDSelectorBitmap` built on each call from the same owner
   column and table (numpy gather + packbits): the same visibility filter, also exact. That
   bitmap's numpy preparation is the FAISS user's per-call work when visibility changes per caller,
   but it is not FAISS's: a second FAISS column ("search only") times the search alone with the
   bitmap built before the timed window, the lower bound of any FAISS-based recall. Calls
   alternate in turn; every answer is checked equal (the same rows, scores within 1e-5). p50/p99
   in microseconds.
2. Embedding throughput: --texts texts of 5-120 words through gpu_worker.engine.embedding (the
   packed all-MiniLM-L6-v2, var/identity.aotxccir) and through sentence-transformers' `encode`
   on the same model (its package directory), batch 32 on both, alternating --rounds times;
   the cosine between the two outputs is reported beside the texts/s.

Both libraries use the same torch/BLAS threads (torch's default: one per core). Reported as
ratios (ours over theirs: > 1 is faster for throughput, < 1 is faster for latency)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # not bench/: bench/http.py would shadow the standard library's http

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpu_worker.memory.recall import recall, visibility_table  # noqa: E402

DIM, OWNERS, K = 384, 200, 10


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def recall_phase(rows: int, visible_share: float, queries: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.functional.normalize(torch.randn(rows, DIM, generator=g), dim=1).contiguous()
    owners = torch.randint(1, OWNERS + 1, (rows,), generator=g)  # owner slot + 1
    owners[torch.randperm(rows, generator=g)[: rows // 20]] = 0  # 5% free rows
    visible = torch.randperm(OWNERS, generator=g)[: max(1, int(OWNERS * visible_share))] + 1
    index = faiss.IndexFlatIP(DIM)
    index.add(embeddings.numpy())
    owners_np, visible_np = owners.numpy(), visible.numpy()
    qs = torch.nn.functional.normalize(torch.randn(queries, DIM, generator=g), dim=1)

    def ours(q: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        got = recall(embeddings, owners, visibility_table(visible, OWNERS + 1), q, K)
        return got.rows[0].numpy(), got.scores[0].numpy()

    def bitmap_params() -> faiss.SearchParameters:
        table = np.zeros(OWNERS + 1, dtype=bool)
        table[visible_np] = True
        mask = table[owners_np]
        bitmap = np.packbits(mask, bitorder="little")
        return faiss.SearchParameters(sel=faiss.IDSelectorBitmap(bitmap))

    def theirs(q: np.ndarray, params: faiss.SearchParameters | None = None) -> tuple[np.ndarray, np.ndarray]:
        scores, labels = index.search(q, K, params=params or bitmap_params())
        return labels[0], scores[0]

    ready = bitmap_params()  # built once, outside every timed window: "search only"
    calls = [("ours", lambda n: ours(qs[n])), ("faiss", lambda n: theirs(qs_np[n])),
             ("faiss search only", lambda n: theirs(qs_np[n], ready))]
    qs_np = [q.numpy().reshape(1, DIM) for q in qs]
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    mismatches = 0
    for n in range(queries):
        turn = calls[n % 3:] + calls[:n % 3]  # each first, second and third in turn
        answers = {}
        for name, fn in turn:
            t = time.perf_counter()
            answers[name] = fn(n)
            times[name].append((time.perf_counter() - t) * 1e6)
        (r1, s1) = answers["ours"]
        for name in ("faiss", "faiss search only"):
            r2, s2 = answers[name]
            if not (np.array_equal(r1, r2) and np.allclose(s1, s2, atol=1e-5)):
                mismatches += 1
    visible_rows = int(np.isin(owners_np, visible_np).sum())
    out = {"rows": rows, "visible_rows": visible_rows, "mismatches": mismatches}
    for name, values in times.items():
        values = values[5:]  # the first calls warm caches and allocators
        out[name] = (percentile(values, 0.5), percentile(values, 0.99))
    return out


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("memory recall space conversation participant the a of to and in is it receipt journal "
             "publication owner room instance lease revision model token page").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) for _ in range(n)]


def embedding_phase(texts: int, rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from gpu_worker.engine.embedding import EmbeddingModel
    from gpu_worker.pack import default_embedding_dir
    from gpu_worker.storage.runtime_file import RuntimeFile

    runtime = os.path.join(ROOT, "var", "identity.aotxccir")
    if not os.path.exists(runtime):
        sys.exit(f"{runtime} is missing: `make setup` packs it")
    st = SentenceTransformer(str(default_embedding_dir()), device="cpu")
    ours = EmbeddingModel.from_runtime(RuntimeFile.open(runtime))
    data = corpus(texts, 1)
    reference = st.encode(data, batch_size=32, convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(reference, ours.encode(data)).min().item()
    rates: dict[str, list[float]] = {"ours": [], "sentence-transformers": []}
    for r in range(rounds):
        pair = [("ours", lambda: ours.encode(data)),
                ("sentence-transformers", lambda: st.encode(data, batch_size=32))]
        if r % 2:
            pair.reverse()
        for name, fn in pair:
            t = time.perf_counter()
            fn()
            rates[name].append(texts / (time.perf_counter() - t))
    return {"cosine_min": cosine, "dtype": str(ours.dtype).removeprefix("torch."),
            **{name: statistics.median(values) for name, values in rates.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000,100000")
    parser.add_argument("--visible", default="0.02,0.5", help="shares of the owners the caller sees")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), faiss {faiss.__version__}")
    print(f"\nrecall: one query, exact top-{K}, {DIM} dims, {OWNERS} owners; microseconds")
    print("| rows | visible | ours p50 | ours p99 | FAISS p50 | FAISS p99 | search only p50 | search only p99 "
          "| p50 ratio | p99 ratio | p50 ratio, search only | p99 ratio, search only | answers differing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(x) for x in args.rows.split(",")):
        for share in (float(x) for x in args.visible.split(",")):
            r = recall_phase(rows, share, args.queries, seed=rows)
            (o50, o99), (f50, f99), (s50, s99) = r["ours"], r["faiss"], r["faiss search only"]
            print(f"| {rows:,} | {r['visible_rows']:,} | {o50:.0f} | {o99:.0f} | {f50:.0f} | {f99:.0f} | {s50:.0f} "
                  f"| {s99:.0f} | {f50 / o50:.2f}x | {f99 / o99:.2f}x | {s50 / o50:.2f}x | {s99 / o99:.2f}x "
                  f"| {r['mismatches']} of {2 * args.queries} |")
    print("(ratio: FAISS time over ours; above 1 means ours is faster. \"search only\": FAISS's search "
          "with its bitmap built beforehand)")
    e = embedding_phase(args.texts, args.rounds)
    print(f"\nembedding: {args.texts} texts of 5-120 words, batch 32, median of {args.rounds} rounds")
    print(f"ours ({e['dtype']} matmuls): {e['ours']:.1f} texts/s; sentence-transformers: "
          f"{e['sentence-transformers']:.1f} texts/s; ratio {e['ours'] / e['sentence-transformers']:.2f}x; "
          f"min cosine {e['cosine_min']:.6f}")


if __name__ == "__main__":
    main()
