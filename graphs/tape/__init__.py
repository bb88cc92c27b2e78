"""The op tape: the CPU graph backend, faithful to CUDA graphs (``graphs.tape.backend``).

One module per stage of a segment's life: ``recording`` (a dispatch mode that runs each op,
checks its ``legality`` and picks its replay plan by ``planning``, each candidate checked bit for
bit by ``checking``), ``linking`` (plans built into ``steps`` over tensors resolved from
``refs``, intermediates re-homed into ``memory``), ``stale`` (what recording leaves behind until
the first replay).
"""

from graphs.tape.backend import TapeBackend, TapeSegment
from graphs.tape.memory import TapePool

__all__ = ["TapeBackend", "TapePool", "TapeSegment"]
