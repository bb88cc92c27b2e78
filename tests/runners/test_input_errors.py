"""Bad input to the Python API: every refusal is an ``InputError`` with a one-line message, and
``build_engine`` sets the thread count ``dsv4 run`` would.

``InputError`` lives at the ground floor (``graphs.errors``) so every package's bad-input errors
derive from it; ``runners`` exports it beside ``build_engine``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import runners
from graphs import InputError
from runners import EngineSpec, SamplingParams, build_engine

PACKAGES = ("graphs", "platforms", "dsv4", "runners")
NOT_INPUT_ERRORS = {
    # a misuse of the capture machinery or a device this machine lacks: the program's, not input
    "graphs.errors.CaptureError",
    "graphs.errors.CaptureAuditError",
    "graphs.errors.BackendUnavailableError",
    # what went wrong while running, not what the caller passed
    "runners.engine.errors.EngineError",
    "runners.engine.errors.ExecutorError",
    "runners.engine.request.RequestFailedError",
    "runners.distributed.RankFailedError",
    "runners.distributed.GroupOutlivedError",
    "runners.measure.hf_baseline.BaselineUnavailableError",
    "runners.measure.load_memory.LoadMemoryError",
    "runners.measure.serving_load.ServerUnreachableError",
    "runners.serve.engine_loop.EngineDeadError",
    "runners.cli.serve.EngineFailedError",
    # an HTTP error object the server sends (its status says whose fault), not raised to callers
    "runners.serve.errors.ApiError",
}


def _error_classes() -> Iterator[type[BaseException]]:
    for package in PACKAGES:
        root = importlib.import_module(package)
        names = [package] + [
            m.name for m in pkgutil.walk_packages(root.__path__, prefix=f"{package}.")
        ]
        for name in names:
            module = importlib.import_module(name)
            for _, value in inspect.getmembers(module, inspect.isclass):
                error = issubclass(value, Exception) and not issubclass(value, Warning)
                if error and value.__module__ == name:
                    yield value


def test_every_error_class_of_the_library_is_an_input_error_or_named_as_not_one() -> None:
    classes = {f"{c.__module__}.{c.__qualname__}": c for c in _error_classes()}
    assert set(classes) >= NOT_INPUT_ERRORS
    stray = [n for n, c in classes.items() if not issubclass(c, InputError)]
    assert sorted(set(stray) - NOT_INPUT_ERRORS) == []
    assert runners.InputError is InputError


BAD_INPUTS: dict[str, Callable[[], object]] = {
    "dtype float64": lambda: EngineSpec(dtype="float64"),
    "quantization": lambda: EngineSpec(quantization="int3"),
    "audit mode": lambda: EngineSpec(audit="loud"),  # type: ignore[arg-type]
    "threads": lambda: EngineSpec(threads=0),
    "runner": lambda: build_engine(EngineSpec(runner="v3")),
    "graph mode": lambda: build_engine(EngineSpec(cudagraph_mode="FAST")),
    "eager region": lambda: build_engine(EngineSpec(eager_region="middle")),
    "unsafe region": lambda: build_engine(
        EngineSpec(platform="cpu", runner="v1", eager_region="narrow")
    ),
    "unknown platform": lambda: build_engine(EngineSpec(platform="nope")),
    "capture size 0": lambda: build_engine(EngineSpec(capture_sizes=(0,))),
    "capture size above the budget": lambda: build_engine(EngineSpec(capture_sizes=(128,))),
    "context bucket 0": lambda: build_engine(EngineSpec(first_context_bucket=0)),
    "graph contexts": lambda: build_engine(EngineSpec(max_graph_contexts=0)),
    "max_model_len": lambda: build_engine(EngineSpec(max_model_len=10**9)),
    "max_num_seqs": lambda: build_engine(EngineSpec(max_num_seqs=0)),
    "kv budget": lambda: build_engine(EngineSpec(kv_cache_memory=10)),
    "memory fraction": lambda: build_engine(EngineSpec(memory_fraction=2.0)),
    "checkpoint": lambda: build_engine(EngineSpec(checkpoint=Path("/nonexistent/ckpt"))),
    "parallel size": lambda: build_engine(EngineSpec(tensor_parallel_size=3)),
    "sampling": lambda: SamplingParams(temperature=-1.0),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_a_bad_input_is_one_input_error_with_one_line(case: str) -> None:
    with pytest.raises(InputError) as refused:
        BAD_INPUTS[case]()
    message = str(refused.value)
    assert message and "\n" not in message
    assert not message.startswith("("), message  # not a raw tuple of exception arguments


def test_an_engine_spec_field_outside_its_choices_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^EngineSpec.dtype 'float64' is not one of: auto, "):
        EngineSpec(dtype="float64")


def test_build_engine_runs_a_small_model_on_one_thread_unless_told() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_engine(EngineSpec(platform="cpu", cudagraph_mode="NONE"))
        assert torch.get_num_threads() == 1  # the CLI's default for hidden sizes up to 512
        build_engine(EngineSpec(platform="cpu", cudagraph_mode="NONE", threads=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
