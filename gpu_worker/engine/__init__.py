"""The generation engine: the project's own LLaMA forward over a paged KV pool (docs/engine.md).

sequence (a request), block_manager (the page pool), scheduler (admission), model (the forward),
model_runner (batches over the pool, CUDA graphs), sampling, tokenizer, engine (the loop).
"""

from gpu_worker.engine.engine import Engine, PoolStats
from gpu_worker.engine.scheduler import EngineRefusal
from gpu_worker.engine.sequence import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Sequence, Status
from gpu_worker.engine.tokenizer import Tokenizer

__all__ = ["Engine", "EngineRefusal", "PoolStats", "Sequence", "Status", "Tokenizer",
           "FINISH_STOP", "FINISH_LENGTH", "FINISH_CANCELLED"]
