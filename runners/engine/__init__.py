"""The engine: requests, sampling, continuous batching with chunked prefill, KV block bookkeeping.

Host-side only: it talks to the model through the ``StepExecutor`` protocol (``executor``), which a
``ModelRunner`` satisfies.
"""

from runners.engine.block_pool import BlockPool
from runners.engine.errors import (
    EngineConfigError,
    EngineError,
    ExecutorError,
    InvalidRequestError,
    RequestFailedError,
    RequestTooLongError,
)
from runners.engine.executor import StepExecutor
from runners.engine.llm import LLM, EngineStats, GenerateProgress
from runners.engine.params import SamplingParams
from runners.engine.request import FinishReason, RequestOutput

__all__ = [
    "LLM",
    "BlockPool",
    "EngineConfigError",
    "EngineError",
    "EngineStats",
    "ExecutorError",
    "FinishReason",
    "GenerateProgress",
    "InvalidRequestError",
    "RequestFailedError",
    "RequestOutput",
    "RequestTooLongError",
    "SamplingParams",
    "StepExecutor",
]
