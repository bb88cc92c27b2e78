"""Linking a recorded segment into replay steps, and deciding where its tensors live.

When a segment ends, the linker (1) keeps as *constants* the factory and literal outputs that
nothing wrote after creation and nothing but the tape references, and drops their steps; (2)
re-homes every storage allocated in the segment that no one references any more (*internal*)
into the backend's arena, at offsets planned by lifetime (``graphs.tape.memory``); (3) resolves
each recorded tensor reference to the tensor replay must use — the original object when it is
alive with the metadata the op saw, else a tensor over the same (or re-homed) storage with that
metadata; and (4) builds each record's plan into a zero-argument step.
"""

from __future__ import annotations

from typing import Any

import torch

from graphs._tensor_refs import storage_key
from graphs.errors import CaptureError
from graphs.tape.memory import Lifetime, SegmentMemory, TapePool, plan_offsets
from graphs.tape.recording import Recorder
from graphs.tape.refs import TensorRef, alias, map_leaves, same_view
from graphs.tape.steps import Const, Step

__all__ = ["Linker"]


def _use_count(key: int) -> int | None:
    """How many references a storage has, where torch tells (a private API; else ``None``)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(key))


class Linker:
    """Turns a finished recording into steps, re-homing internal storages into the arena."""

    def __init__(self, recorder: Recorder, pool: TapePool) -> None:
        self.recorder = recorder
        # A factory output nothing writes and nothing but the tape references keeps its
        # captured value forever: hold it as a constant and skip its refill.
        self.constants = {
            key: storage
            for key, storage in recorder.factory_outputs.items()
            if key not in recorder.written and _use_count(key) == 1
        }
        recorder.factory_outputs.clear()
        internal = [
            Lifetime(key=key, nbytes=info.nbytes, first=info.first, last=info.last)
            for key, info in recorder.storages.items()
            if info.weak.expired()
        ]
        self.homes: dict[int, tuple[torch.UntypedStorage, int]] = {}
        arena_bytes = 0
        for device in {recorder.storages[b.key].device for b in internal}:
            blocks = [b for b in internal if recorder.storages[b.key].device == device]
            offsets, total = plan_offsets(blocks)
            arena = pool.arena(device, total)
            arena_bytes += total
            self.homes.update({key: (arena, offset) for key, offset in offsets.items()})
        self.memory = SegmentMemory(
            arena_bytes=arena_bytes,
            internal_bytes=sum(b.nbytes for b in internal),
            retained_bytes=sum(
                info.nbytes
                for key, info in recorder.storages.items()
                if key not in self.homes and key not in self.constants
            ),
            constant_bytes=sum(s.nbytes() for s in self.constants.values())
            + sum(
                r.plan.saved.untyped_storage().nbytes()
                for r in recorder.records
                if isinstance(r.plan, Const) and r.constant_key not in self.constants
            ),
        )
        self._aliases: dict[tuple[Any, ...], torch.Tensor] = {}

    def resolve(self, ref: TensorRef) -> torch.Tensor:
        """The tensor replay must use for a recorded reference."""
        home = self.homes.get(ref.key)
        if home is None:
            t = ref.tensor()
            if t is not None and same_view(t, ref):
                return t
        cache_key = (ref.key, ref.dtype, ref.offset, ref.size, ref.stride)
        cached = self._aliases.get(cache_key)
        if cached is None:
            cached = self._alias(ref, home)
            self._aliases[cache_key] = cached
        return cached

    def _alias(self, ref: TensorRef, home: tuple[torch.UntypedStorage, int] | None) -> torch.Tensor:
        itemsize = torch.empty((), dtype=ref.dtype).element_size()
        if home is not None:
            arena, byte_offset = home
            return alias(
                arena, ref.dtype, byte_offset // itemsize + ref.offset, ref.size, ref.stride
            )
        t = ref.tensor()
        storage: torch.UntypedStorage | None = None
        if t is not None and storage_key(t) == ref.key:
            storage = t.untyped_storage()
        elif ref.key in self.recorder.storages:
            storage = self.recorder.storages[ref.key].weak.get()
        if storage is None:
            raise CaptureError("a tensor recorded by the tape lost its storage before replay")
        return alias(storage, ref.dtype, ref.offset, ref.size, ref.stride)

    def steps(self) -> list[Step]:
        steps = []
        for record in self.recorder.records:
            if record.constant_key in self.constants:
                continue
            args = map_leaves(self.resolve, record.args, TensorRef)
            kwargs = map_leaves(self.resolve, record.kwargs, TensorRef)
            outs = [self.resolve(o) for o in record.outs]
            steps.append(record.plan.build(args, kwargs, outs))
        return steps
