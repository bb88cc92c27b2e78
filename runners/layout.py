"""``CacheLayout``: the shape of the paged KV caches and the block table a runner allocates."""

from __future__ import annotations

import attrs

__all__ = ["CacheLayout"]


@attrs.frozen(kw_only=True)
class CacheLayout:
    """Blocks of both pools, block size and block-table shape; ``max_context`` follows from
    them."""

    num_blocks: int = attrs.field(validator=attrs.validators.gt(0))
    """KV-cache blocks in total, ids ``0 .. num_blocks-1``."""
    block_size: int = attrs.field(validator=attrs.validators.gt(0))
    """Tokens per block."""
    max_rows: int = attrs.field(validator=attrs.validators.gt(0))
    """Requests that can be in flight at once (rows of the block table)."""
    max_blocks_per_row: int = attrs.field(validator=attrs.validators.gt(0))
    """Blocks one request can address."""
    num_entry_blocks: int = attrs.field(
        default=attrs.Factory(lambda layout: layout.num_blocks, takes_self=True),
        validator=attrs.validators.gt(0),
    )
    """Entry-pool blocks in total (``block_size`` compressed entries each); default: as many as
    ``num_blocks``, never too few while nothing is freed."""

    @property
    def max_context(self) -> int:
        """The longest request, in tokens."""
        return self.max_blocks_per_row * self.block_size
