"""The generation engine: requests in, one token per running request per step out.

One owner thread calls `submit`, `step` and `cancel`. Each `step` is one scheduling round: admit a
group (scheduler.py), decode every request that was already running by one token in a single batched
forward, and prefill the newly admitted group, which yields each of them its first token. A request
finishes on a stop token or stop string ("stop"), at its output limit or page capacity ("length"),
or when cancelled ("cancelled"); its pages return to the pool at once.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import torch

from gpu_worker.contract.limits import MAX_TOP_LOGPROBS
from gpu_worker.engine.block_manager import BlockManager, page_hashes, pages_for
from gpu_worker.engine.grammar import Grammar, Grammars, apply_biases, fill_masks, mask_biases, mask_words
from gpu_worker.engine.model import CPU_WEIGHTS, Llama
from gpu_worker.engine.model_runner import ModelRunner
from gpu_worker.engine.pacing import TokenPacer
from gpu_worker.engine.sampling import penalize, sample
from gpu_worker.engine.scheduler import EngineRefusal, Scheduler
from gpu_worker.engine.shares import Activity
from gpu_worker.engine.sequence import FINISH_CANCELLED, Sequence, Status
from gpu_worker.engine.tokenizer import Tokenizer
from gpu_worker.engine.vision import PreparedImage, VisionTower
from gpu_worker.storage.runtime_file import RuntimeFile


@dataclass(frozen=True)
class PoolStats:
    total: int     # pages in the KV pool (runtime profile kv_pages)
    free: int      # pages an allocation may take: the free list and unheld cached pages
    owned: int     # the whole page limits of the running requests (a shared cached page counts in each)
    used: int      # owned pages that already hold keys and values
    reserved: int  # owned pages kept for tokens not generated yet
    pending: int   # page limits of the requests waiting for admission
    running: int
    waiting: int


# A sampled token's log-probability and its top alternatives [(token_id, log-probability), ...], most
# likely first: for requests that asked for logprobs (None otherwise, and for a stop token).
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# (request_id, token_id (None for a failure of its own), released output bytes, finish reason or None, its
# TokenLogprobs or None)
StepEvent = tuple[object, "int | None", bytes, "str | None", "TokenLogprobs | None"]
# A step's grammar masks are computed while its forward runs; their thread answering later than this
# fails the constrained sequences rather than stalling the engine.
MASK_TIMEOUT_S = 10.0
FINISH_GRAMMAR_FAILED = "failed:grammar"
# a step's masks (biases or bits, grammar.py), and each constrained sequence's row in them
Masks = tuple[torch.Tensor, "dict[Sequence, int]"]


class Engine:
    def __init__(self, runtime_file: RuntimeFile | str | os.PathLike[str], device: str = "cpu", seed: int = 0, *,
                 dtype: torch.dtype | None = None,
                 max_running: int = 256, cuda_graphs: bool = True, fused_kernels: bool | None = None,
                 prefix_cache: bool = True, cpu_weights: str = CPU_WEIGHTS[0]):
        runtime = runtime_file if isinstance(runtime_file, RuntimeFile) else RuntimeFile.open(runtime_file)
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        profile = runtime.runtime_profile
        self.card = runtime.json("gen/card")
        self.page_size, self.page_grant = profile["page_size"], profile["page_grant"]
        self.seed = seed
        self.tokenizer = Tokenizer.from_runtime(runtime)
        # constrained decoding (grammar.py): compiled on helper threads, masks on a thread of their own
        self.grammars = Grammars(runtime.bytes("gen/tokenizer").tobytes().decode("utf-8"), self.card["vocab_size"],
                                 self.card.get("eos_token_id"))
        self._mask_thread: ThreadPoolExecutor | None = None
        self.model = Llama.from_runtime(runtime, self.device, dtype, fused_kernels, cpu_weights)
        # a vision-language model's image encoder (vision.py; None for a text model). Its `prepare`
        # runs on helper threads, never the engine's: submit takes what it returns.
        self.vision = VisionTower.from_runtime(runtime, self.device, dtype)
        self.image_token_id: int | None = self.card.get("image_token_id")
        self.block_manager = BlockManager(profile["kv_pages"])
        self.prefix_cache = prefix_cache  # reuse the KV pages of earlier requests' prefixes (block_manager.py)
        self.scheduler = Scheduler(self.block_manager, page_grant=self.page_grant, max_running=max_running,
                                   page_size=self.page_size)
        self.runner = ModelRunner(self.model, num_pages=profile["kv_pages"], page_size=self.page_size,
                                  max_batch=max_running, max_pages_per_seq=self.page_grant,
                                  cuda_graphs=cuda_graphs and self.device.type == "cuda")
        self.default_stop_ids = frozenset({self.card["eos_token_id"]} if self.card.get("eos_token_id") is not None
                                          else ())
        self._sequences: dict[object, Sequence] = {}
        self._generated = 0
        self.pacer = TokenPacer()  # output tokens per second per tenant (pacing.py; the device sets rate_of)
        self.activity = Activity()  # the tenants sharing the engine: shares bind among them (shares.py)
        self.idle_for = 0.0  # after a step: seconds until the next one can do anything (every tenant held)

    # ---- requests ---------------------------------------------------------------------------------

    def submit(self, request_id: object, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, stop: Iterable[int | str] = (), page_limit: int | None = None,
               seed: int | None = None, ignore_eos: bool = False, tenant: Hashable = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logprobs: int | None = None,
               images: Iterable[PreparedImage] = (), grammar: Grammar | None = None) -> Sequence:
        """Queue a request. `stop` holds token ids (int) and strings (str) that end it besides the model's EOS
        (unless `ignore_eos`, which benchmarks use to generate exactly max_new_tokens). `tenant` (the
        principal it is for) is its queue in the scheduler's round-robin (scheduler.py). `logprobs`
        (0..MAX_TOP_LOGPROBS top alternatives) gives each sampled token's log-probability in its step event:
        the model's distribution after the penalties, before temperature and top_p (as vLLM reports).
        `page_limit` defaults to the pages its prompt and max_new_tokens need, at most the page grant; it is
        reserved whole at admission, and a request that reaches it finishes with "length".
        `images` (VisionTower.prepare, for a vision-language model): their features go in place of the
        prompt's image tokens, in order; they must be as many as those tokens.
        `grammar` (Grammars.compile): every token is sampled among those it allows next, and the
        request finishes ("stop") when it is complete; stop strings cannot be combined with it."""
        if request_id in self._sequences:
            raise EngineRefusal("duplicate_request", f"request {request_id!r} is already queued or running")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise EngineRefusal("empty_prompt", "the prompt has no tokens")
        vocab = self.card["vocab_size"]
        if not all(0 <= t < vocab for t in prompt_ids):
            raise EngineRefusal("token_out_of_range", f"prompt token ids must lie in [0, {vocab})")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise EngineRefusal("invalid_max_new_tokens",
                                f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
        if not 0 <= temperature < float("inf"):
            raise EngineRefusal("invalid_temperature", f"temperature must be finite and >= 0, not {temperature!r}")
        if not 0 < top_p <= 1:
            raise EngineRefusal("invalid_top_p", f"top_p must lie in (0, 1], not {top_p!r}")
        if not all(abs(p) < float("inf") for p in (presence_penalty, frequency_penalty)):
            raise EngineRefusal("invalid_penalty", "presence and frequency penalties must be finite")
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise EngineRefusal("invalid_logprobs", f"logprobs must be an integer 0..{MAX_TOP_LOGPROBS} or None")
        if page_limit is None:
            page_limit = min(pages_for(len(prompt_ids) + max_new_tokens - 1, self.page_size), self.page_grant)
        if type(page_limit) is not int or page_limit < 1:
            raise EngineRefusal("invalid_page_limit", f"page limit must be a positive integer, not {page_limit!r}")
        capacity = min(page_limit * self.page_size, self.card["max_position_embeddings"])
        if len(prompt_ids) > capacity:
            raise EngineRefusal("prompt_exceeds_page_limit",
                                f"a prompt of {len(prompt_ids)} tokens does not fit in {page_limit} pages "
                                f"of {self.page_size} tokens (or the model's {self.card['max_position_embeddings']})")
        images = list(images)
        image_positions = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id] \
            if self.image_token_id is not None else []
        features = torch.cat([image.features for image in images]) if images else None
        if len(image_positions) != (0 if features is None else features.shape[0]):
            raise EngineRefusal("image_tokens_mismatch",
                                f"the prompt has {len(image_positions)} image tokens and the images "
                                f"{0 if features is None else features.shape[0]} feature rows")
        if features is not None and features.shape[1] != self.card["hidden_size"]:
            raise EngineRefusal("image_tokens_mismatch", "image features do not have the model's hidden size")
        stop_ids = frozenset(s for s in stop if isinstance(s, int))
        stop_strings = tuple(s.encode("utf-8") for s in stop if isinstance(s, str) and s)
        if grammar is not None and stop_strings:
            raise EngineRefusal("grammar_with_stop", "stop strings cannot be combined with a grammar (they could cut "
                                                     "its answer short of complete)")
        if seed is None:
            # Derived from the engine seed and the request id, so a rerun reproduces every sampled request.
            digest = hashlib.sha256(f"{self.seed}:{request_id!r}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little") >> 1
        seq = Sequence(request_id, prompt_ids, max_new_tokens, page_limit, capacity, float(temperature), float(top_p),
                       stop_ids if ignore_eos else self.default_stop_ids | stop_ids, stop_strings, seed, tenant,
                       float(presence_penalty), float(frequency_penalty), logprobs)
        if grammar is not None:
            seq.matcher = grammar.matcher()
        if images:
            seq.image_positions, seq.image_features = image_positions, features
            # pages holding image tokens are equal only for equal images: their digests salt the chain
            seq.cache_salt = (tenant, tuple(image.digest for image in images))
        if self.prefix_cache:
            seq.page_hashes = page_hashes(seq.cache_salt, prompt_ids, self.page_size,
                                          len(prompt_ids) // self.page_size)
        self.scheduler.add(seq)  # raises EngineRefusal for a page limit above the pool or the grant
        self._sequences[request_id] = seq
        return seq

    def cancel(self, request_id: object) -> bool:
        """Stop a waiting or running request now and free its pages; False when it is unknown or already finished."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq)
        seq.finish(FINISH_CANCELLED)
        return True

    def get(self, request_id: object) -> Sequence | None:
        return self._sequences.get(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._sequences)

    @property
    def pool(self) -> PoolStats:
        running = self.scheduler.running
        owned = self.scheduler.budgeted  # whole page limits: a shared cached page counts in each holder
        # distinct pages: a cached prefix page several requests share is used once
        used = len({page for seq in running for page in seq.pages[:pages_for(seq.num_cached, self.page_size)]})
        return PoolStats(total=self.block_manager.num_pages, free=self.block_manager.num_free, owned=owned,
                         used=used, reserved=owned - used, pending=self.scheduler.pending_pages,
                         running=len(running), waiting=self.scheduler.num_waiting)

    # ---- execution ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One forward pass: the running sequences' next tokens (but those of tenants the pacer
        holds) and the next admission group's prefill. `idle_for` is then the seconds the caller
        may sleep before the next step does anything (0: step again at once)."""
        scheduler = self.scheduler
        running = scheduler.running
        active = self.activity.saw({seq.tenant for seq in running}.union(scheduler.queues))
        held = self.pacer.held([seq.tenant for seq in running], active) if running else set()
        decoding = [seq for seq in running if seq.tenant not in held] if held else list(running)
        group = scheduler.admit(active)
        self.pacer.charge([seq.tenant for seq in decoding + group], active)
        self.idle_for = self.pacer.wait(held) if held and not decoding and not group else 0.0
        for seq in group:
            if seq.temperature > 0:
                seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        events = []
        masks = self._start_masks(decoding + group)
        if decoding:
            events += self._advance(decoding, self.runner.decode(decoding), masks)
        if group:
            events += self._advance(group, self.runner.prefill(group), masks)
            for seq in group:
                seq.image_features = None  # in the pool now, as keys and values
            if self.prefix_cache:  # their prompt pages are written: later prompts may share them
                for seq in group:
                    full = len(seq.prompt_ids) // self.page_size
                    self.block_manager.register(seq.pages[:full], seq.page_hashes[:full])
        return events

    def _release(self, seq: Sequence) -> None:
        """A request ends: its written full pages stay cached (the next turn of a conversation
        starts with them), then its pages go back."""
        if self.prefix_cache and seq.pages:
            # keys and values are written for every token but the newest (a finished request's
            # status no longer says running, so num_cached cannot tell)
            written = (seq.length - 1 if seq.output_ids else 0) // self.page_size
            known = len(seq.page_hashes)
            if written > known:
                tokens = seq.prompt_ids + seq.output_ids
                seq.page_hashes += page_hashes(seq.cache_salt, tokens, self.page_size, written,
                                               seq.page_hashes[-1] if known else None, known)
            self.block_manager.register(seq.pages[:written], seq.page_hashes[:written])
        self.scheduler.release(seq)

    def _start_masks(self, seqs: list[Sequence]) -> "Future[Masks] | None":
        """The grammar masks of this step's constrained sequences, computed on the mask thread
        while the forward runs (their matchers have taken every token sampled so far): as logit
        biases on the CPU, as bits for a GPU."""
        constrained = [seq for seq in seqs if seq.matcher is not None]
        if not constrained:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

        vocab, on_cpu = self.card["vocab_size"], self.device.type == "cpu"

        def compute() -> Masks:
            bits = fill_masks([seq.matcher for seq in constrained], mask_words(vocab))
            # on the CPU the biases are made here too, beside the forward; a GPU makes its own from the bits
            return mask_biases(bits, vocab) if on_cpu else bits, {seq: i for i, seq in enumerate(constrained)}
        return self._mask_thread.submit(compute)

    def _constrain(self, seqs: list[Sequence], logits: torch.Tensor,
                   masks: "Future[Masks] | None") -> tuple[torch.Tensor, set[int]]:
        """The logits with each constrained row's disallowed tokens at -inf; and the rows whose
        masks did not come (the mask thread failed or overran its bound: they fail)."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return logits, set()
        assert masks is not None  # _start_masks saw these sequences
        try:
            found, at = masks.result(timeout=MASK_TIMEOUT_S)  # waker: the mask thread's completion
        except Exception:  # noqa: BLE001 - a matcher's failure fails its sequences, never the engine
            return logits, set(rows)
        first = at[seqs[rows[0]]]
        mine = [at[seqs[i]] for i in rows]  # (decoding's then the group's: each a run of the step's masks)
        return apply_biases(logits, rows, found[first:first + len(rows)] if mine == list(
            range(first, first + len(rows))) else found[mine]), set()

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor,
                 masks: "Future[Masks] | None" = None) -> list[StepEvent]:
        penalized = [(i, s.output_ids, s.presence_penalty, s.frequency_penalty) for i, s in enumerate(seqs)
                     if s.presence_penalty or s.frequency_penalty]
        if penalized:
            logits = penalize(logits, penalized)
        logits, failed = self._constrain(seqs, logits, masks)
        wanted = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        log_probs = torch.log_softmax(logits[wanted].float(), dim=-1) if wanted else None
        tokens = sample(logits, [s.temperature for s in seqs], [s.top_p for s in seqs], [s.generator for s in seqs])
        details = dict(zip(wanted, self._logprobs([seqs[i] for i in wanted], [tokens[i] for i in wanted], log_probs)))
        events: list[StepEvent] = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            matcher = seq.matcher
            if matcher is not None and (i in failed or not matcher.consume_token(token)):
                self._release(seq)
                del self._sequences[seq.request_id]
                seq.finish(FINISH_GRAMMAR_FAILED)
                events.append((seq.request_id, None, b"", FINISH_GRAMMAR_FAILED, None))  # (no token of its own)
                continue
            complete = matcher is not None and matcher.is_stopped()
            released, reason = seq.append(token, self.tokenizer.token_bytes(token), complete)
            if reason is not None:
                self._release(seq)
                del self._sequences[seq.request_id]
            events.append((seq.request_id, token, released, reason, details.get(i)))
        return events

    @staticmethod
    def _logprobs(seqs: list[Sequence], tokens: list[int], log_probs: torch.Tensor | None) -> list[TokenLogprobs | None]:
        """Each sampled token's log-probability and its sequence's top alternatives (none for a stop token:
        it adds nothing to the output)."""
        if log_probs is None:
            return []
        most = max(seq.logprobs or 0 for seq in seqs)
        chosen = log_probs.gather(1, torch.tensor(tokens, device=log_probs.device)[:, None])[:, 0].tolist()
        top = log_probs.topk(most, dim=-1) if most else None
        values: list[list[float]] = top.values.tolist() if top is not None else [[] for _ in seqs]
        ids: list[list[int]] = top.indices.tolist() if top is not None else [[] for _ in seqs]
        return [None if token in seq.stop_token_ids else
                (chosen[j], list(zip(ids[j][:seq.logprobs or 0], values[j][:seq.logprobs or 0])))
                for j, (seq, token) in enumerate(zip(seqs, tokens))]

    def generate(self, prompts: list[list[int]], **settings: Any) -> list[Sequence]:
        """Run `prompts` (token ids) to completion together; keyword settings as for `submit`."""
        seqs = []
        for prompt in prompts:
            self._generated += 1
            seqs.append(self.submit(f"generate-{self._generated}", prompt, **settings))
        while any(seq.status is not Status.FINISHED for seq in seqs):
            self.step()
            if self.idle_for:  # every sequence's tenant is paced and held
                time.sleep(self.idle_for)
        return seqs
