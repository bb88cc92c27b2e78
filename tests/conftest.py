"""Shared test configuration: hypothesis profiles, the `cuda` marker and one torch thread.

Profiles (choose with ``HYPOTHESIS_PROFILE``):
- ``dev``: few examples, fast feedback while editing.
- ``ci``: derandomized, so a CI failure reproduces exactly; the default under ``make test``.
- ``thorough``: many examples for long runs before a release.

``DSV4_KERNEL_ISA=avx2`` (or ``baseline``) runs the whole suite as a CPU without AVX-512 (or
without AVX) would (``dsv4_isa``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import dsv4_isa

dsv4_isa.apply_requested()  # before torch runs anything: ``DSV4_KERNEL_ISA`` caps the whole run

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``@pytest.mark.cuda`` test, with a reason, where no CUDA device exists; keep
    the tests of a module that share a module-scoped fixture on one xdist worker; hand out the
    ``@pytest.mark.slow`` tests (with their groups) first, so the workers end on short tests
    together instead of one waiting out another's long one."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    for item in items:
        if _shares_a_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or class-scoped fixture other than ``one_thread``: an
    expensive object (a model, a checkpoint, a captured runner) built once for its module. Under
    ``--dist loadgroup`` such a module's tests go to one worker, which builds it once; the other
    tests are spread one by one."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope in ("module", "class") and name != "one_thread"
        for name, definitions in info.name2fixturedefs.items()
        for definition in definitions
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread for every test module, restored after it: eager steps, captures
    and replays then split work alike (the references the tests compare with are computed the
    same way), and tiny models run fastest so. Module-scoped, so it is in force before the
    module-scoped fixtures that build models and reference outputs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dsv4 init-checkpoint --preset tiny --seed 0``, written once per session (per worker): the
    built-in model's weights with the small byte-level BPE tokenizer. Read it; edit a copy
    (``ckpt``)."""
    from runners.cli.main import main

    directory = tmp_path_factory.mktemp("tiny-seed-0") / "ckpt"
    assert main(["init-checkpoint", str(directory), "--preset", "tiny", "--seed", "0"]) == 0
    return directory


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of ``tiny_checkpoint`` whose JSON files a test may edit (the weights are
    links to the shared ones, which it must not change)."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for path in tiny_checkpoint.iterdir():
        if path.suffix == ".safetensors":
            (copy / path.name).symlink_to(path)
        else:
            (copy / path.name).write_bytes(path.read_bytes())
    return copy
