"""The Python API's parallel engine (``runners.launch_engine``), from outside: two local ranks
give the logits (within the CPU float32 tolerance) and the greedy tokens of one, before and after
capture; what the model cannot split is refused before any process starts; a rank killed
mid-generation, or one that fails while building, stops every rank with one line naming it; a
Ctrl-C in the driver leaves the engine usable; no rank outlives its engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import dsv4_rank
import runners.ranked
from dsv4 import DeepseekV4Config
from dsv4.checkpoint import save_random_checkpoint
from dsv4.parallel import ParallelSizeError
from platforms import CpuPlatform
from runners import EngineSpec, SamplingParams, build_engine
from runners.distributed import RankFailedError
from runners.engine import GenerateProgress, ScheduledChunk
from runners.errors import PlatformNotImportableError
from runners.modes import CUDAGraphMode
from runners.ranked import RankedEngine, launch_engine
from runners.shared_logits import shared_memory_dir

SPEC = EngineSpec(platform="cpu", capture_sizes=(1, 2), tensor_parallel_size=2)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=6)
ATOL = 5e-5
"""DESIGN's CPU float32 equality tolerance."""


def _gone(pids: tuple[int, ...]) -> bool:
    """Every one of ``pids`` has exited and been reaped."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def _no_start() -> Any:
    raise AssertionError("a rank was started")


@pytest.fixture(scope="module")
def engine() -> Iterator[RankedEngine]:
    with launch_engine(SPEC) as launched:
        yield launched
    assert _gone(launched.ranks.pids)


@pytest.fixture(scope="module")
def one_rank_tokens() -> list[tuple[int, ...]]:
    single = build_engine(attrs.evolve(SPEC, tensor_parallel_size=1))
    return [o.output_ids for o in single.llm.generate(PROMPTS, GREEDY)]


def test_two_ranks_give_the_tokens_of_one_before_and_after_capture(
    engine: RankedEngine, one_rank_tokens: list[tuple[int, ...]]
) -> None:
    assert [o.output_ids for o in engine.llm.generate(PROMPTS, GREEDY)] == one_rank_tokens
    engine.ranks.capture()
    assert engine.resolution.decode_mode is CUDAGraphMode.PIECEWISE  # FULL downgraded
    single = build_engine(attrs.evolve(SPEC, tensor_parallel_size=1, cudagraph_mode="PIECEWISE"))
    single.runner.capture()
    keys = engine.ranks.captured
    assert set(keys) == set(single.runner.captured)
    # Every gloo collective of a forward is one more break in each graph: the embedding's
    # all-reduce, each layer's two (attention, MoE), the logits' gather.
    collectives = 2 + 2 * single.runner.model.config.num_hidden_layers
    breaks = engine.ranks.num_eager_breaks
    assert breaks == single.runner.num_eager_breaks + len(keys) * collectives
    assert engine.ranks.num_graphs == breaks + len(keys)  # one more segment than breaks
    assert [o.output_ids for o in engine.llm.generate(PROMPTS, GREEDY)] == one_rank_tokens


def test_the_shared_logits_file_has_no_name_left_while_the_engine_runs(
    engine: RankedEngine,
) -> None:
    directory = Path(shared_memory_dir() or tempfile.gettempdir())
    assert engine.ranks.size == 2
    path = Path(engine.ranks._logits.path)  # this engine's file (other engines may run)
    assert path.parent == directory and path.name.startswith("dsv4-logits-")
    assert not path.exists()


def test_two_ranks_compute_the_logits_of_one(engine: RankedEngine) -> None:
    single = build_engine(attrs.evolve(SPEC, tensor_parallel_size=1, cudagraph_mode="NONE"))
    chunks = [
        ScheduledChunk(row=0, block_ids=(0,), start_position=0, num_tokens=5),
        ScheduledChunk(row=1, block_ids=(1,), start_position=0, num_tokens=3),
    ]
    expected = single.runner.execute(chunks, PROMPTS)
    logits = engine.ranks.execute(chunks, PROMPTS)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_a_ctrl_c_in_the_driver_leaves_the_engine_usable(
    engine: RankedEngine, one_rank_tokens: list[tuple[int, ...]]
) -> None:
    # SIGINT 50 ms after the first step, while 199 steps remain: it lands inside the call,
    # most often while the driver waits for the ranks' reply (the case the engine must undo).
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))

    def interrupt_soon(progress: GenerateProgress) -> None:
        if progress.generated_tokens and timer.ident is None:
            timer.start()

    try:
        with pytest.raises(KeyboardInterrupt):
            engine.llm.generate(PROMPTS, SamplingParams(max_tokens=200), progress=interrupt_soon)
    finally:
        timer.cancel()  # never a stray SIGINT after the call
        if timer.ident is not None:
            timer.join()
    assert not engine.llm.has_unfinished()  # the interrupted call's requests were aborted
    assert [o.output_ids for o in engine.llm.generate(PROMPTS, GREEDY)] == one_rank_tokens


def test_a_size_the_model_cannot_split_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runners.ranked, "_start_rank", _no_start)
    with pytest.raises(
        ParallelSizeError, match=r"^tensor-parallel size 4 does not divide o_groups"
    ):
        launch_engine(attrs.evolve(SPEC, tensor_parallel_size=4))


class _ScriptPlatform(CpuPlatform):
    """A platform class as a script would define it, in ``__main__``."""

    name = "script"


_ScriptPlatform.__module__ = "__main__"


def test_a_platform_the_ranks_cannot_import_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runners.ranked, "_start_rank", _no_start)
    with pytest.raises(PlatformNotImportableError) as refused:
        launch_engine(attrs.evolve(SPEC, platform=_ScriptPlatform()))
    assert str(refused.value) == (
        "platform class _ScriptPlatform is defined in __main__, which the ranks cannot import: "
        "move it to a module, or register it as a plugin and pass its name"
    )


def test_a_rank_killed_mid_generation_stops_every_rank_with_one_line() -> None:
    engine = launch_engine(SPEC)
    pids = engine.ranks.pids

    def kill_rank_1(progress: GenerateProgress) -> None:
        if progress.generated_tokens > 0:
            os.kill(pids[1], signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(RankFailedError) as failed:
        engine.llm.generate(PROMPTS, SamplingParams(max_tokens=40), progress=kill_rank_1)
    assert time.monotonic() - start < 30
    assert str(failed.value) == "rank 1 died (killed by signal 9)"
    assert _gone(pids)
    assert not engine.llm.has_unfinished()
    with pytest.raises(RankFailedError, match=r"^rank 1 died"):  # and so does every later call
        engine.llm.generate(PROMPTS, GREEDY)
    engine.close()  # idempotent


def test_a_rank_that_fails_to_build_is_named_and_no_rank_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_random_checkpoint(tmp_path / "ckpt", DeepseekV4Config.tiny(), seed=3)
    shard = directory / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])  # the config reads; the weights do not
    started: list[int] = []
    start_rank = runners.ranked._start_rank

    def recorded() -> Any:
        conn, process = start_rank()
        started.append(process.pid)
        return conn, process

    monkeypatch.setattr(runners.ranked, "_start_rank", recorded)
    with pytest.raises(RankFailedError) as failed:
        launch_engine(attrs.evolve(SPEC, checkpoint=directory))
    assert str(failed.value).startswith("rank 0 failed: CheckpointError: cannot read ")
    assert "truncated" in str(failed.value) and "\n" not in str(failed.value)
    assert len(started) == 2 and _gone(tuple(started))


def test_a_closed_engine_refuses_work_in_one_line() -> None:
    with launch_engine(attrs.evolve(SPEC, tensor_parallel_size=1)) as engine:
        pids = engine.ranks.pids
    assert _gone(pids)
    with pytest.raises(RankFailedError, match=r"^the engine is closed$"):
        engine.llm.generate(PROMPTS, GREEDY)


def test_a_ctrl_c_during_a_send_is_held_until_the_send_ends() -> None:
    """What keeps the ranks in step: a SIGINT between the sends of one command (some ranks
    would run a step the others never see) is raised only after the last send."""
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt), dsv4_rank.ctrl_c_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the interpreter runs signal handlers here
        reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_build_engine_outside_a_process_group_points_to_launch_engine() -> None:
    with pytest.raises(ParallelSizeError) as refused:
        build_engine(SPEC)
    assert str(refused.value) == (
        "tensor_parallel_size 2 needs a process group of 2 ranks: use runners.launch_engine, "
        "which starts them, or run under torchrun"
    )


def _rank_pids(driver: int) -> list[int]:
    """The rank processes ``driver`` started (children running ``serve_rank``), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == driver and b"serve_rank" in command:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_ranks_whose_driver_is_killed_while_they_start_exit_within_seconds() -> None:
    """The ranks watch their driver before importing the library: killed while they import
    torch, they exit at once rather than when the import ends and the pipe is found closed."""
    script = (
        "import runners; runners.launch_engine("
        "runners.EngineSpec(platform='cpu', tensor_parallel_size=2))"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(ranks := _rank_pids(driver.pid)) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.02)
    driver.kill()
    driver.wait()
    killed = time.monotonic()
    while not all(_exited(pid) for pid in ranks) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    assert all(_exited(pid) for pid in ranks) and time.monotonic() - killed < 3.0


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie its adopter has not reaped yet has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
