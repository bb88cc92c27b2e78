"""The engine: requests, sampling, continuous batching with chunked prefill, KV block bookkeeping.

Host-side only (it imports nothing of ``dsv4``): it talks to the model through the
``StepExecutor`` protocol (``executor``: ``ScheduledChunk``s in, logits out, ``EngineLimits`` to
schedule within), which a ``ModelRunner`` satisfies.
"""

from runners.engine.block_pool import BlockPool
from runners.engine.errors import (
    EngineConfigError,
    EngineError,
    ExecutorError,
    InvalidRequestError,
    RequestTooLongError,
)
from runners.engine.executor import EngineLimits, ScheduledChunk, StepExecutor
from runners.engine.llm import LLM, EngineStats, GenerateProgress
from runners.engine.params import SamplingParams
from runners.engine.prefix_cache import PrefixCacheStats
from runners.engine.request import (
    FinishReason,
    Listener,
    RequestFailedError,
    RequestOutput,
    RequestUpdate,
    TokenLogprob,
)
from runners.engine.text import Detokenize

__all__ = [
    "LLM",
    "BlockPool",
    "Detokenize",
    "EngineConfigError",
    "EngineError",
    "EngineLimits",
    "EngineStats",
    "ExecutorError",
    "FinishReason",
    "GenerateProgress",
    "InvalidRequestError",
    "Listener",
    "PrefixCacheStats",
    "RequestFailedError",
    "RequestOutput",
    "RequestTooLongError",
    "RequestUpdate",
    "SamplingParams",
    "ScheduledChunk",
    "StepExecutor",
    "TokenLogprob",
]
