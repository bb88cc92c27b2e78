"""Capacity: from what a user chooses (maximum context, sequences, block size, KV memory) to
the cache layout a runner allocates.

Invariants:
- The number of KV blocks follows from the KV memory budget and the model's cache bytes per
  token (every layer's sliding-window cache, compressor state and entries, indexer keys;
  ``dsv4.cache.bytes_per_token``): ``num_blocks * block_size * bytes_per_token <= budget``. It
  never exceeds what ``max_num_seqs`` requests of the maximum context need, so a small model
  does not take memory it can never use.
- The budget is ``kv_cache_memory`` bytes when given, else ``memory_fraction`` of the device's
  free memory measured after the model is loaded. When neither is given it is
  ``DEFAULT_MEMORY_FRACTION`` of free memory, and at most ``DEFAULT_CPU_KV_CACHE_MEMORY`` on the
  CPU, where the caches share memory with everything else (vLLM's CPU backend defaults to the
  same 4 GiB).
- ``max_model_len`` defaults to the checkpoint's ``max_position_embeddings``; when the budget
  cannot hold one request of that length, it is capped to what the budget holds, with a note.
  An explicit ``max_model_len`` above ``max_position_embeddings``, or one the budget cannot
  hold, is refused (``CapacityError``, one line), as is any non-positive value.
- Everything that needs only the config (``Capacity.check``) is checked before the model loads.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from dsv4.cache import bytes_per_token
from dsv4.config import DeepseekV4Config
from runners.layout import CacheLayout

__all__ = [
    "DEFAULT_CPU_KV_CACHE_MEMORY",
    "DEFAULT_MEMORY_FRACTION",
    "Capacity",
    "CapacityError",
    "CapacityPlan",
    "MaxModelLenCappedWarning",
    "free_memory",
]

DEFAULT_MEMORY_FRACTION = 0.5
"""Share of the device's free memory the KV caches may take when no budget is given."""
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30
"""The most the KV caches take on the CPU when no budget is given."""


class CapacityError(ValueError):
    """A capacity choice that cannot be served (one line naming the option)."""


class MaxModelLenCappedWarning(UserWarning):
    """The checkpoint's ``max_position_embeddings`` does not fit the KV budget; the maximum
    context was capped to what does (``CapacityPlan.note``)."""


def _positive(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise CapacityError(f"{attribute.name} must be a positive integer, got {value!r}")


def _fraction(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not 0.0 < value <= 1.0:
        raise CapacityError(f"memory_fraction must be in (0, 1], got {value!r}")


@attrs.frozen(kw_only=True)
class Capacity:
    """What a user chooses about capacity (the CLI's ``--max-model-len`` … options)."""

    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    """Longest request in tokens; ``None``: the checkpoint's ``max_position_embeddings``."""
    max_num_seqs: int = attrs.field(default=16, validator=_positive)
    """Requests in flight at once (block-table rows)."""
    block_size: int = attrs.field(default=16, validator=_positive)
    """Tokens per KV block."""
    kv_cache_memory: int | None = attrs.field(default=None, validator=_positive)
    """KV memory budget in bytes; ``None``: a share of free device memory."""
    memory_fraction: float | None = attrs.field(default=None, validator=_fraction)
    """Share of free device memory the KV caches may take (``DEFAULT_MEMORY_FRACTION``)."""

    def __attrs_post_init__(self) -> None:
        if self.kv_cache_memory is not None and self.memory_fraction is not None:
            raise CapacityError("give kv_cache_memory or memory_fraction, not both")

    def check(self, config: DeepseekV4Config, dtype: torch.dtype) -> None:
        """Refuse what the config and the cache dtype alone rule out (before anything is
        loaded)."""
        limit = config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise CapacityError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if self.kv_cache_memory is not None:
            self._blocks_for_budget(_per_token(config, dtype), self.kv_cache_memory)

    def plan(
        self, config: DeepseekV4Config, dtype: torch.dtype, device: torch.device
    ) -> CapacityPlan:
        """The layout for ``config``'s caches in ``dtype`` on ``device`` (see the invariants)."""
        self.check(config, dtype)
        if self.kv_cache_memory is not None:
            budget = self.kv_cache_memory
        elif self.memory_fraction is not None:
            budget = int(free_memory(device) * self.memory_fraction)
        else:
            budget = int(free_memory(device) * DEFAULT_MEMORY_FRACTION)
            if device.type == "cpu":
                budget = min(budget, DEFAULT_CPU_KV_CACHE_MEMORY)
        per_token = _per_token(config, dtype)
        budget_blocks = self._blocks_for_budget(per_token, budget)
        declared = config.max_position_embeddings
        length = declared if self.max_model_len is None else self.max_model_len
        note = None
        if -(-length // self.block_size) > budget_blocks:
            if self.max_model_len is not None:
                raise CapacityError(
                    f"max_model_len {length} needs {_mib(length * per_token)} of KV cache for "
                    f"one request; the budget is {_mib(budget)} (raise kv_cache_memory or "
                    "memory_fraction, or lower max_model_len)"
                )
            length = budget_blocks * self.block_size
            note = (
                f"max-model-len capped to {length} tokens by the KV cache budget "
                f"{_mib(budget)} (the checkpoint declares {declared})"
            )
        blocks_per_seq = -(-length // self.block_size)
        layout = CacheLayout(
            num_blocks=min(budget_blocks, self.max_num_seqs * blocks_per_seq),
            block_size=self.block_size,
            max_rows=self.max_num_seqs,
            max_blocks_per_row=blocks_per_seq,
        )
        return CapacityPlan(
            layout=layout,
            max_model_len=length,
            budget_bytes=budget,
            bytes_per_token=per_token,
            note=note,
        )

    def _blocks_for_budget(self, per_token: int, budget: int) -> int:
        per_block = self.block_size * per_token
        blocks = budget // per_block
        if blocks < 1:
            raise CapacityError(
                f"the KV cache budget {_mib(budget)} holds no block of {self.block_size} tokens "
                f"({_mib(per_block)} each); raise kv_cache_memory or memory_fraction"
            )
        return blocks


@attrs.frozen(kw_only=True)
class CapacityPlan:
    """The derived layout and what it was derived from (``run --json`` reports it)."""

    layout: CacheLayout
    max_model_len: int
    budget_bytes: int
    bytes_per_token: int
    """Cache bytes of one token across every layer."""
    note: str | None
    """One line when ``max_model_len`` was capped by the budget."""

    def to_dict(self) -> dict[str, int | str | None]:
        layout = self.layout
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": layout.max_rows,
            "block_size": layout.block_size,
            "num_blocks": layout.num_blocks,
            "max_blocks_per_seq": layout.max_blocks_per_row,
            "kv_cache_bytes": layout.num_blocks * layout.block_size * self.bytes_per_token,
            "kv_budget_bytes": self.budget_bytes,
            "kv_bytes_per_token": self.bytes_per_token,
            "note": self.note,
        }


def free_memory(device: torch.device) -> int:
    """Free memory of ``device`` in bytes: the CUDA/HIP driver's figure on a GPU, the kernel's
    ``MemAvailable`` on the CPU. Raises ``CapacityError`` for a device it cannot ask."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise CapacityError(
        f"cannot measure free memory on a {device.type} device; give kv_cache_memory"
    )


def _per_token(config: DeepseekV4Config, dtype: torch.dtype) -> int:
    """Cache bytes of one token across every layer of ``config``."""
    per_type = bytes_per_token(config, dtype)
    return sum(per_type[layer_type] for layer_type in config.layer_types)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
