"""The DeepSeek-V4 model: config, strategy-composed attention, paged caches, checkpoints.

Tensor and expert parallelism: ``TensorParallel`` names a rank (``dsv4.parallel``),
``DeepseekV4ForCausalLM(..., parallel=)``/``load_checkpoint(..., parallel=)`` build or load its
share, ``shard_model`` takes it from a full model (``dsv4.sharding``).

The model keeps no per-run state: each step's metadata, paged caches and eager region reach it
through the forward context (``graphs.forward_context``).

Imports ``graphs`` only (never ``platforms`` or ``runners``); resolves nothing at import time.
"""

from dsv4.attention import DeepseekV4Attention
from dsv4.cache import CompressorCache, LayerCache, PagedKVCaches, allocate_kv_caches
from dsv4.checkpoint import load_checkpoint, save_random_checkpoint
from dsv4.config import DeepseekV4Config, YarnScaling
from dsv4.errors import CheckpointError, ConfigError
from dsv4.metadata import AttentionMetadata, ChunkLike, MetadataBuffers, new_metadata
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.parallel import SINGLE, ParallelSizeError, TensorParallel, check_parallel_size
from dsv4.sharding import shard_model

__all__ = [
    "SINGLE",
    "AttentionMetadata",
    "CheckpointError",
    "ChunkLike",
    "CompressorCache",
    "ConfigError",
    "DeepseekV4Attention",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "LayerCache",
    "MetadataBuffers",
    "PagedKVCaches",
    "ParallelSizeError",
    "TensorParallel",
    "YarnScaling",
    "allocate_kv_caches",
    "check_parallel_size",
    "load_checkpoint",
    "new_metadata",
    "save_random_checkpoint",
    "shard_model",
]
