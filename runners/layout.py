"""``CacheLayout``: the shape of the paged KV caches and the block table a runner allocates."""

from __future__ import annotations

from typing import Any

import attrs

from runners.errors import SpecError

__all__ = ["CacheLayout"]


def _positive(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"CacheLayout.{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class CacheLayout:
    """Blocks of both pools, block size and block-table shape; ``max_context`` follows from
    them."""

    num_blocks: int = attrs.field(validator=_positive)
    """KV-cache blocks in total, ids ``0 .. num_blocks-1``."""
    block_size: int = attrs.field(validator=_positive)
    """Tokens per block."""
    max_rows: int = attrs.field(validator=_positive)
    """Requests that can be in flight at once (rows of the block table)."""
    max_blocks_per_row: int = attrs.field(validator=_positive)
    """Blocks one request can address."""
    num_entry_blocks: int = attrs.field(
        default=attrs.Factory(lambda layout: layout.num_blocks, takes_self=True),
        validator=_positive,
    )
    """Entry-pool blocks in total (``block_size`` compressed entries each); default: as many as
    ``num_blocks``, never too few while nothing is freed."""
    max_model_len: int | None = attrs.field(default=None)
    """The longest request in tokens, at most the ``max_blocks_per_row`` blocks' tokens (``None``:
    all of them): a ``--max-model-len`` that is not a whole number of blocks is held as given."""

    def __attrs_post_init__(self) -> None:
        addressable = self.max_blocks_per_row * self.block_size
        if self.max_model_len is not None:
            _positive(self, attrs.fields(CacheLayout).max_model_len, self.max_model_len)
            if self.max_model_len > addressable:
                raise SpecError(
                    f"CacheLayout.max_model_len {self.max_model_len} exceeds the "
                    f"{self.max_blocks_per_row} blocks of {self.block_size} tokens a row addresses"
                )

    @property
    def max_context(self) -> int:
        """The longest request, in tokens."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.max_blocks_per_row * self.block_size
