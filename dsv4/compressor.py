"""The attention layer's KV compressor (CSA: overlapping, with the lightning indexer; HCA: not).

The pooling itself (and why it is capturable) is ``dsv4.pooling.WindowPooler``; this class only
adds the indexer a CSA layer owns, so parameter names match the reference
(``compressor.*`` and ``compressor.indexer.*``).
"""

from __future__ import annotations

from dsv4.indexer import Indexer
from dsv4.pooling import WindowPooler

__all__ = ["Compressor"]


class Compressor(WindowPooler):
    """KV compressor at ``head_dim``; ``indexer`` is set for CSA layers only."""

    def __init__(
        self,
        hidden_size: int,
        dim: int,
        rate: int,
        *,
        overlap: bool,
        eps: float,
        indexer: Indexer | None = None,
    ) -> None:
        super().__init__(hidden_size, dim, rate, overlap=overlap, eps=eps)
        self.indexer = indexer
