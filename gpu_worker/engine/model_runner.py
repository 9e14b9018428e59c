"""Turns scheduled sequences into model inputs over the paged KV pool and returns next-token logits.

The pool has one page beyond the runtime profile's `kv_pages`: the scratch page. Padding tokens
(short prompts in a prefill batch, empty rows of a CUDA-graph batch) write their keys and values
there and their block tables point there, so padding never touches a page a sequence owns and the
pool's accounting stays exactly the profile's.

On CUDA the decode step is replayed from CUDA graphs. A decode step of a small model is hundreds
of tiny kernels, and launching them one by one from Python costs more than running them; a graph
launches them all at once. Graphs need fixed shapes, so batches are padded up to a batch-size bucket
and block tables up to a page-count bucket, and one graph is captured per bucket pair on first use.
CPU never takes that path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpu_worker.engine.block_manager import pages_for
from gpu_worker.engine.model import Llama
from gpu_worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# tokens, positions, slots `[batch, 1]` and block tables `[batch, pages]` (ModelRunner.unpack)
DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# Padded tokens per prefill forward: bounds the activation memory of a large admission group.
PREFILL_TOKENS = 8192


def _buckets(limit: int, small: tuple[int, ...]) -> list[int]:
    return sorted({*(n for n in small if n < limit), limit})


class ModelRunner:
    def __init__(self, model: Llama, *, num_pages: int, page_size: int, max_batch: int, max_pages_per_seq: int,
                 cuda_graphs: bool = False):
        self.model = model
        self.page_size = page_size
        self.scratch_page = num_pages
        self.kv_cache = model.new_kv_cache(num_pages + 1, page_size)
        self.graphs = DecodeGraphs(self, max_batch, max_pages_per_seq) if cuda_graphs else None

    def _tensors(self, *rows_of_rows: list[Any]) -> list[torch.Tensor]:
        return [torch.tensor(rows, dtype=torch.int64).to(self.model.device, non_blocking=True) for rows in rows_of_rows]

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.pages[position // self.page_size] * self.page_size + position % self.page_size

    def _table(self, seq: Sequence, pages: int) -> list[int]:
        own = seq.pages[:pages]
        return own + [self.scratch_page] * (pages - len(own))

    def prefill_inputs(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """tokens, positions, slots `[B, longest uncached prompt part]`, block tables `[B, pages]` (every
        page up to the longest prompt: the cached prefix is attended to where it lies), last `[B]`.
        A prompt whose first `cached_tokens` are in the pool already (the prefix cache) is prefilled
        from there on."""
        width = max(len(seq.prompt_ids) - seq.cached_tokens for seq in seqs)
        pages = pages_for(max(len(seq.prompt_ids) for seq in seqs), self.page_size)
        scratch = self.scratch_page * self.page_size
        tokens, positions, slots, tables, last = [], [], [], [], []
        for seq in seqs:
            start, n = seq.cached_tokens, len(seq.prompt_ids)
            pad = width - (n - start)
            tokens.append(seq.prompt_ids[start:] + [0] * pad)
            positions.append(list(range(start, n)) + [0] * pad)
            slots.append([self._slot(seq, p) for p in range(start, n)] + [scratch] * pad)
            tables.append(self._table(seq, pages))
            last.append(n - start - 1)
        return self._tensors(tokens, positions, slots, tables, last)

    def decode_inputs(self, seqs: list[Sequence], batch: int | None = None, pages: int | None = None) -> torch.Tensor:
        """One int64 CPU tensor `[batch, 3 + pages]`, a row per sequence: its newest token, that token's position
        and slot, then its block table; padded with scratch rows up to `batch` rows and `pages` pages (default:
        just enough). One tensor, so a step makes one host-to-device copy; `unpack` gives the model's inputs."""
        batch = batch or len(seqs)
        pages = pages or max(pages_for(seq.length, self.page_size) for seq in seqs)
        rows = [[seq.last_token, seq.length - 1, self._slot(seq, seq.length - 1), *self._table(seq, pages)]
                for seq in seqs]
        rows += [[0, 0, self.scratch_page * self.page_size] + [self.scratch_page] * pages] * (batch - len(seqs))
        return torch.tensor(rows, dtype=torch.int64)

    @staticmethod
    def unpack(inputs: torch.Tensor) -> DecodeInputs:
        """tokens, positions, slots `[batch, 1]` and block tables `[batch, pages]`: views of decode_inputs' tensor."""
        return inputs[:, 0:1], inputs[:, 1:2], inputs[:, 2:3], inputs[:, 3:]

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Writes every prompt's keys and values; returns logits `[len(seqs), vocab]` after each prompt."""
        chunk: list[Sequence]
        logits, chunk, width = [], [], 0
        for seq in seqs:
            width = max(width, len(seq.prompt_ids) - seq.cached_tokens)
            if chunk and (len(chunk) + 1) * width > PREFILL_TOKENS:
                logits.append(self._prefill(chunk))
                chunk, width = [], len(seq.prompt_ids) - seq.cached_tokens
            chunk.append(seq)
        logits.append(self._prefill(chunk))
        return torch.cat(logits)

    def prefill_embeds(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image features of the rows' uncached prompt parts, with their flat indices in the
        `[B, width]` batch of prefill_inputs (None when no row has any)."""
        if not any(seq.image_positions for seq in seqs):
            return None
        width = max(len(seq.prompt_ids) - seq.cached_tokens for seq in seqs)
        index: list[int] = []
        rows: list[torch.Tensor] = []
        for b, seq in enumerate(seqs):
            if not seq.image_positions:
                continue
            start = seq.cached_tokens
            chosen = [j for j, p in enumerate(seq.image_positions) if p >= start]
            index += [b * width + seq.image_positions[j] - start for j in chosen]
            assert seq.image_features is not None  # set with image_positions
            rows.append(seq.image_features[chosen[0]:] if chosen else seq.image_features[:0])
        device = self.model.device
        return torch.tensor(index, dtype=torch.int64, device=device), torch.cat(rows).to(device)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        tokens, positions, slots, tables, last = self.prefill_inputs(seqs)
        return self.model(tokens, positions, slots, tables, self.kv_cache, last=last, embeds=self.prefill_embeds(seqs))

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Writes each sequence's newest token; returns logits `[len(seqs), vocab]` for the token after it."""
        if self.graphs is not None:
            pages = max(pages_for(seq.length, self.page_size) for seq in seqs)
            return self.graphs.replay(self.decode_inputs(seqs, *self.graphs.bucket(len(seqs), pages)))[:len(seqs)]
        inputs = self.decode_inputs(seqs).to(self.model.device, non_blocking=True)
        return self.model(*self.unpack(inputs), self.kv_cache)[:, -1]


class DecodeGraphs:
    """CUDA graphs of the decode step, one per (batch bucket, page bucket), captured on first use."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_pages: int):
        self.runner = runner
        self.batch_sizes = _buckets(max_batch, (1, 2, 4, 8, *range(16, max_batch, 16)))
        self.page_counts = _buckets(max_pages, tuple(2 ** i for i in range(max_pages.bit_length())))
        # One static output every graph writes its leading rows of, so no graph holds its own logits.
        self.logits = torch.empty(max_batch, runner.model.config.vocab_size, dtype=runner.model.dtype,
                                  device=runner.model.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # each graph's static decode_inputs
        self.pool: _POOL_HANDLE | None = None  # one memory pool for all graphs: they never run at the same time

    def bucket(self, batch: int, pages: int) -> tuple[int, int]:
        return (next(b for b in self.batch_sizes if b >= batch), next(p for p in self.page_counts if p >= pages))

    def replay(self, inputs: torch.Tensor) -> torch.Tensor:
        """Runs the graph of `inputs`' bucket (decode_inputs padded to it) after one copy of them to the GPU."""
        batch, pages = inputs.shape[0], inputs.shape[1] - 3
        static = self.inputs.get((batch, pages))
        if static is None:
            static = self.inputs[batch, pages] = inputs.to(self.runner.model.device)
            self.graphs[batch, pages] = self._capture(ModelRunner.unpack(static))
        else:
            static.copy_(inputs, non_blocking=True)
        self.graphs[batch, pages].replay()
        return self.logits[:batch]

    def _capture(self, static: DecodeInputs) -> torch.cuda.CUDAGraph:
        model, kv_cache = self.runner.model, self.runner.kv_cache
        # Warm up on a side stream first (as torch.cuda.graph expects), so kernel selection and lazy
        # initialisation happen outside the capture. It computes this very step, so its writes are the
        # same ones the replay makes.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(*static, kv_cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other device threads may keep using CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.logits[:len(static[0])].copy_(model(*static, kv_cache)[:, -1])
        self.pool = graph.pool()
        return graph
