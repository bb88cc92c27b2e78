"""The lockstep machine catches a prefix cache that restores too little or the wrong state.

Each mutant below is a plausible bug, applied with ``monkeypatch``; each scenario is a short run
of the machine of ``test_prefix_cache_lockstep`` (its operations called by hand) that passes on
the real code and fails, with the mutant, by the machine's own checks. A first prompt runs to
completion first in every scenario, as the machine's ``initialize`` does, then the prompts that
expose the mutant, one after another.

- **hash without the parent**: a block's key ignores the blocks before it, so a prompt that
  differs from ``T`` in its first token only finds ``T``'s blocks and entries;
- **a block reused past its lookback**: a block the engine releases past a request's lookback
  goes back to the free list while the cache still finds it (``share`` takes it back); the next
  hit reads a freed block (NaN, or another request's);
- **the compressor's state skipped**: a hit keeps the sliding window's blocks (one position)
  instead of the whole lookback, so the CSA compressor and the indexer, whose overlapping
  windows read the two positions before a boundary, read a block the hit does not hold;
- **a partial entry block shared**: hits end at multiples of ``block_size * entry_rate`` (4)
  instead of ``prefix_boundary`` (8), so an HCA entry (8 tokens) still unfinished at the hit is
  written into an entry block the cache shares, and a later hit reads the wrong one.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from runners.engine import prefix_cache
from runners.engine.block_pool import BlockPool
from runners.engine.kv_blocks import KVBlocks, _retuple
from runners.engine.prefix_cache import PrefixCache
from runners.engine.request import Request
from tests.engine.test_prefix_cache_lockstep import CONFIG, RUNNERS, CachingAgainstPlain

T = [(5 * i + 7) % CONFIG.vocab_size for i in range(24)]
U = [(11 * i + 2) % CONFIG.vocab_size for i in range(24)]
Mutant = Callable[[pytest.MonkeyPatch], None]


def hash_without_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    original = prefix_cache.block_hash
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: original(b"", tokens))


def block_reused_past_its_lookback(monkeypatch: pytest.MonkeyPatch) -> None:
    def release_passed(self: KVBlocks, request: Request) -> None:
        assert self.lookback is not None
        passed = max(0, request.num_computed - self.lookback + 1) // self.block_size
        released = request.block_ids[: passed - request.released]
        if released:
            self.blocks.free(released)
            for block in released:  # the bug: free for reuse, yet still found by its key
                if self.blocks.is_idle(block):
                    del self.blocks._idle[block]
                    self.blocks._free.append(block)
            del request.block_ids[: len(released)]
            request.released = passed
            _retuple(request)

    def share(self: BlockPool, ids: list[int]) -> None:
        for block in ids:
            if block in self._free:
                self._free.remove(block)
            self._idle.pop(block, None)
            self._refs[block] += 1

    monkeypatch.setattr(KVBlocks, "release_passed", release_passed)
    monkeypatch.setattr(BlockPool, "share", share)


def compressor_state_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    init = PrefixCache.__init__

    def window_only(self: PrefixCache, **kwargs: object) -> None:
        init(self, **kwargs)  # type: ignore[arg-type]
        self.lookback = CONFIG.sliding_window

    monkeypatch.setattr(PrefixCache, "__init__", window_only)


def partial_entry_block_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = RUNNERS["caching"]
    limits = runner.limits
    monkeypatch.setattr(runner, "limits", attrs.evolve(limits, prefix_boundary=4))


def run(first: list[int], requests: list[list[int]]) -> CachingAgainstPlain:
    """``first`` to completion, then each prompt of ``requests`` to completion in turn."""
    machine = CachingAgainstPlain()
    machine.shared_texts([first, U], max_tokens=2)
    for prompt in requests:
        machine.submit(prompt, 3)
        while machine.caching.has_unfinished() or machine.plain.has_unfinished():
            machine.step(1)
            machine.requests_both_finished_agree()
            machine.blocks_are_accounted_for()
    machine.finish()
    return machine


SCENARIOS: dict[str, tuple[Mutant, list[int], list[list[int]], int]] = {
    "hash without the parent": (hash_without_parent, T, [[T[0] + 1, *T[1:]]], 0),
    "a block reused past its lookback": (block_reused_past_its_lookback, T, [T[:18]], 1),
    "the compressor's state skipped": (compressor_state_skipped, T, [T[:20]], 1),
    "a partial entry block shared": (
        partial_entry_block_shared,
        T[:17],
        [T[:6] + U[:2], T[:17]],  # the first shares 6 tokens: no hit (the mutant: 4 tokens)
        1,
    ),
}
"""Per mutant: the first prompt, the prompts that expose it, and how many of those hit."""


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_scenario_passes_and_hits(name: str) -> None:
    _, first, requests, hits = SCENARIOS[name]
    cache = run(first, requests).caching.stats().prefix_cache
    assert cache is not None and cache.hits == hits


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_mutant_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mutant, first, requests, _ = SCENARIOS[name]
    mutant(monkeypatch)
    with pytest.raises(AssertionError):
        run(first, requests)
