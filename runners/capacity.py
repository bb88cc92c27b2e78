"""Capacity: from what a user chooses (maximum context, sequences, block size, KV memory) to
the cache layout a runner allocates.

Invariants:
- The caches are two pools (``dsv4.cache``): the block pool holds each token's window and
  compressor state, the entry pool each compressed entry. One request holds at most
  ``ceil((lookback - 1 + chunk) / block_size) + 1`` blocks of the first at once (the engine
  frees what left every layer's lookback; ``chunk`` is the step's token budget) and
  ``ceil((max_model_len // entry_rate) / block_size)`` blocks of the second.
- The budget is ``kv_cache_memory`` bytes when given, else ``memory_fraction`` of the device's
  free memory measured after the model is loaded. When neither is given it is
  ``DEFAULT_MEMORY_FRACTION`` of free memory, and at most ``DEFAULT_CPU_KV_CACHE_MEMORY`` on the
  CPU, where the caches share memory with everything else (vLLM's CPU backend defaults to the
  same 4 GiB).
- Both pools get the same share of what ``max_num_seqs`` requests of ``max_model_len`` hold at
  most (all of it when the budget allows, so a small model does not take memory it can never
  use): the pools' bytes never exceed the budget, and one request of ``max_model_len`` always
  fits.
- ``max_model_len`` defaults to the checkpoint's ``max_position_embeddings``; when the budget
  cannot hold one request of that length, it is capped to the longest it holds, with a note.
  An explicit ``max_model_len`` above ``max_position_embeddings``, or one the budget cannot
  hold, is refused (``CapacityError``, one line), as is any non-positive value.
- Everything that needs only the config (``Capacity.check``) is checked before the model loads.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from dsv4.cache import cache_bytes, entry_rate, lookback
from dsv4.config import DeepseekV4Config
from graphs.errors import InputError
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


class CapacityError(InputError, ValueError):
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
            _PoolSizes.of(config, dtype, self.block_size).require_a_block(self.kv_cache_memory)

    def budget(self, device: torch.device) -> int:
        """The KV budget in bytes on ``device`` (see the invariants)."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.memory_fraction is not None:
            return int(free_memory(device) * self.memory_fraction)
        budget = int(free_memory(device) * DEFAULT_MEMORY_FRACTION)
        return min(budget, DEFAULT_CPU_KV_CACHE_MEMORY) if device.type == "cpu" else budget

    def plan(
        self,
        config: DeepseekV4Config,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int,
        *,
        budget: int | None = None,
    ) -> CapacityPlan:
        """The layout for ``config``'s caches in ``dtype`` on ``device``, for steps of at most
        ``chunk`` tokens, within ``budget`` bytes (default: ``budget(device)``; the ranks of a
        parallel run pass their smallest, so they all plan the same layout)."""
        self.check(config, dtype)
        budget = self.budget(device) if budget is None else budget
        sizes = _PoolSizes.of(config, dtype, self.block_size)
        sizes.require_a_block(budget)
        declared = config.max_position_embeddings
        length = declared if self.max_model_len is None else self.max_model_len
        note = None
        if sizes.bytes_of(sizes.per_seq(length, chunk)) > budget:
            if self.max_model_len is not None:
                raise CapacityError(
                    f"max_model_len {length} needs "
                    f"{_mib(sizes.bytes_of(sizes.per_seq(length, chunk)))} of KV cache for one "
                    f"request; the budget is {_mib(budget)} (raise kv_cache_memory or "
                    "memory_fraction, or lower max_model_len)"
                )
            length = sizes.longest_within(budget, chunk)
            note = (
                f"max-model-len capped to {length} tokens by the KV cache budget "
                f"{_mib(budget)} (the checkpoint declares {declared})"
            )
        blocks, entry_blocks = sizes.per_seq(length, chunk)
        share = min(1.0, budget / (self.max_num_seqs * sizes.bytes_of((blocks, entry_blocks))))
        layout = CacheLayout(
            num_blocks=max(blocks, int(self.max_num_seqs * blocks * share)),
            num_entry_blocks=max(entry_blocks, int(self.max_num_seqs * entry_blocks * share)),
            block_size=self.block_size,
            max_rows=self.max_num_seqs,
            max_blocks_per_row=-(-length // self.block_size),
            max_model_len=length,
        )
        return CapacityPlan(
            layout=layout,
            max_model_len=length,
            budget_bytes=budget,
            block_bytes=sizes.block_bytes,
            entry_block_bytes=sizes.entry_block_bytes,
            note=note,
        )


@attrs.frozen
class _PoolSizes:
    """Bytes of one block of each pool, and what one request needs of each."""

    block_size: int
    block_bytes: int
    entry_block_bytes: int
    lookback: int
    entry_rate: int

    @classmethod
    def of(cls, config: DeepseekV4Config, dtype: torch.dtype, block_size: int) -> _PoolSizes:
        per_type = cache_bytes(config, dtype, block_size)
        return cls(
            block_size=block_size,
            block_bytes=block_size * sum(per_type[t].per_token for t in config.layer_types),
            entry_block_bytes=sum(per_type[t].per_entry_block for t in config.layer_types),
            lookback=lookback(config),
            entry_rate=entry_rate(config),
        )

    def per_seq(self, length: int, chunk: int) -> tuple[int, int]:
        """(blocks, entry blocks) one request of ``length`` tokens holds at most at once."""
        size = self.block_size
        blocks = min(-(-length // size), -(-(self.lookback - 1 + chunk) // size) + 1)
        return blocks, max(1, -(-(length // self.entry_rate) // size))

    def bytes_of(self, blocks: tuple[int, int]) -> int:
        return blocks[0] * self.block_bytes + blocks[1] * self.entry_block_bytes

    def longest_within(self, budget: int, chunk: int) -> int:
        """The longest request (a multiple of the block size) one budget holds."""
        low, high = 1, budget // max(1, self.entry_block_bytes) * self.entry_rate + 1
        while low < high:  # the largest block count whose request fits
            middle = (low + high + 1) // 2
            if self.bytes_of(self.per_seq(middle * self.block_size, chunk)) <= budget:
                low = middle
            else:
                high = middle - 1
        return low * self.block_size

    def require_a_block(self, budget: int) -> None:
        if self.bytes_of((1, 1)) > budget:
            raise CapacityError(
                f"the KV cache budget {_mib(budget)} holds no block of {self.block_size} tokens "
                f"({_mib(self.bytes_of((1, 1)))} with its entry block); raise kv_cache_memory "
                "or memory_fraction"
            )


@attrs.frozen(kw_only=True)
class CapacityPlan:
    """The derived layout and what it was derived from (``run --json`` reports it)."""

    layout: CacheLayout
    max_model_len: int
    budget_bytes: int
    block_bytes: int
    """Bytes of one block of the block pool (window and compressor state, every layer)."""
    entry_block_bytes: int
    """Bytes of one block of the entry pool (compressed entries, every layer)."""
    note: str | None
    """One line when ``max_model_len`` was capped by the budget."""

    @property
    def kv_cache_bytes(self) -> int:
        layout = self.layout
        return layout.num_blocks * self.block_bytes + layout.num_entry_blocks * (
            self.entry_block_bytes
        )

    def to_dict(self) -> dict[str, int | str | None]:
        layout = self.layout
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": layout.max_rows,
            "block_size": layout.block_size,
            "num_blocks": layout.num_blocks,
            "num_entry_blocks": layout.num_entry_blocks,
            "max_blocks_per_seq": layout.max_blocks_per_row,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_budget_bytes": self.budget_bytes,
            "block_bytes": self.block_bytes,
            "entry_block_bytes": self.entry_block_bytes,
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
