"""``collector_paused``: the cyclic collector is off inside and as it was after."""

from __future__ import annotations

import gc
import weakref

import pytest

from graphs.heap import collector_paused


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_paused_inside_and_resumed_after() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        cycle = weakref.ref(_Cycle())  # garbage only a collection frees
    assert gc.isenabled()
    assert cycle() is not None  # nothing collected it while paused
    gc.collect()
    assert cycle() is None  # the collector still collects what the block made


def test_a_collector_disabled_before_stays_disabled_even_if_the_block_raises() -> None:
    gc.disable()
    try:
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("inside")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_resumed_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
