"""Out-of-tree platforms discovered through the ``dsv4.platforms`` entry-point group.

Each test installs a small plugin distribution the way pip would leave it on disk — a module and
a ``*.dist-info`` directory with ``METADATA`` and ``entry_points.txt`` — into a temporary
directory put on ``sys.path``, so ``importlib.metadata`` discovers it without a network or an
install step. Module names are unique per test, so nothing leaks between tests.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from graphs import FullGraph, WideRegion
from platforms import (
    AmbiguousPlatformError,
    CpuPlatform,
    PlatformPluginError,
    PlatformRegistry,
    current_platform,
    get_platform,
    platform_names,
    simulate,
    unregister_platform,
)
from runners import CUDAGraphMode, ModelRunnerV1, ModelRunnerV2, resolve
from runners.cli.main import main

PLATFORM_SOURCE = '''
from graphs.strategies import {strategy}
from platforms import CpuPlatform


class {cls}(CpuPlatform):
    """A CPU-backed accelerator named {name!r}."""

    name = {name!r}
    eager_region_strategy = {strategy}()
    eager_region_reason = "platform {name} keeps metadata in host-visible scratch memory"
    v2_excluded_architectures = frozenset({{"DeepseekV4ForCausalLM"}})

    def is_available(self):
        return {available}
'''

DECORATED_SOURCE = '''
from graphs import WideRegion
from platforms import CpuPlatform, register_platform


@register_platform
class DecoratedPlatform(CpuPlatform):
    """Registered on import and named by its entry point, as the README's example is."""

    name = "decorated"
    eager_region_strategy = WideRegion()
'''

_counter = itertools.count()
MakePlugin = Callable[..., str]


@pytest.fixture
def make_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakePlugin:
    """Write a plugin distribution; return the module name it created."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(
        name: str,
        *,
        available: bool = True,
        strategy: str = "WideRegion",
        source: str | None = None,
        target: str = "AccelPlatform",
        entry_name: str | None = None,
    ) -> str:
        module = f"dsv4_test_plugin_{next(_counter)}"
        monkeypatch.delitem(sys.modules, module, raising=False)
        body = source or PLATFORM_SOURCE.format(
            cls="AccelPlatform", name=name, available=available, strategy=strategy
        )
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
        dist = tmp_path / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(
            f"[dsv4.platforms]\n{entry_name or name} = {module}:{target}\n"
        )
        return module

    return make


def test_plugin_is_discovered_and_resolved(make_plugin: MakePlugin) -> None:
    make_plugin("accel")
    platform = get_platform("accel")
    assert platform.eager_region_strategy == WideRegion()
    assert "accel" in PlatformRegistry().names()
    # Its policy drives resolution: V2 is excluded by default, and an explicit V2 still gets
    # the platform's wide region and no FULL graphs.
    default = resolve("DeepseekV4ForCausalLM", platform)
    assert default.runner is ModelRunnerV1
    explicit = resolve("DeepseekV4ForCausalLM", "accel", runner="v2")
    assert explicit.runner is ModelRunnerV2
    assert explicit.eager_region == WideRegion()
    assert explicit.decode_mode is CUDAGraphMode.PIECEWISE
    assert any("platform accel requires the wide region" in r for r in explicit.reasons)


def test_available_plugin_is_the_current_platform(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    make_plugin("accel")
    assert current_platform().name == "accel"
    monkeypatch.setenv("DSV4_PLATFORM", "cpu")
    assert current_platform().name == "cpu"


def test_unavailable_plugin_is_not_current_and_needs_simulation(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    make_plugin("offline", available=False, strategy="FullGraph")
    assert current_platform().name != "offline"
    sim = simulate(get_platform("offline"))
    assert sim.is_available() and sim.eager_region_strategy == FullGraph()


def test_two_available_plugins_are_ambiguous(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    make_plugin("accel-a")
    make_plugin("accel-b")
    with pytest.raises(AmbiguousPlatformError, match=r"accel-a, accel-b.*DSV4_PLATFORM"):
        current_platform()
    monkeypatch.setenv("DSV4_PLATFORM", "accel-b")
    assert current_platform().name == "accel-b"


def test_a_plugin_that_fails_to_import_is_a_loud_error(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    module = make_plugin("broken", source="raise ImportError('accelerator SDK missing')\n")
    loud = rf"'broken'.*{module}.*SDK missing"
    with pytest.raises(PlatformPluginError, match=loud):
        get_platform("broken")
    with pytest.raises(PlatformPluginError, match=loud):  # detection never falls back silently
        current_platform()
    with pytest.raises(PlatformPluginError, match=loud):
        platform_names()
    assert get_platform("cpu") == CpuPlatform()  # a named platform does not load the others


def test_a_plugin_object_that_is_not_a_platform_is_refused(make_plugin: MakePlugin) -> None:
    make_plugin("bogus", source="def make():\n    return 42\n", target="make")
    with pytest.raises(PlatformPluginError, match=r"'bogus'.*42"):
        get_platform("bogus")


def test_a_plugin_must_carry_its_entry_point_name(make_plugin: MakePlugin) -> None:
    make_plugin("accel", entry_name="other")
    with pytest.raises(PlatformPluginError, match="named 'accel'"):
        get_platform("other")


def test_a_plugin_may_not_shadow_a_builtin(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    make_plugin("cuda")
    taken = r"reuses the platform name 'cuda', taken by platforms\.cuda\.CudaPlatform"
    with pytest.raises(PlatformPluginError, match=taken):
        get_platform("cuda")
    with pytest.raises(PlatformPluginError, match=taken):
        current_platform()


def test_a_registered_plugin_is_one_platform_not_a_collision(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    module = make_plugin("decorated", source=DECORATED_SOURCE, target="DecoratedPlatform")
    try:
        platform = get_platform("decorated")  # imports the module: its decorator registers it
        assert platform.eager_region_strategy == WideRegion()
        assert get_platform("cpu") == CpuPlatform()
        assert platform_names().count("decorated") == 1
        assert current_platform() == platform  # one available out-of-tree platform, not two
        reloaded = importlib.reload(sys.modules[module])  # registers the new class in its place
        assert type(get_platform("decorated")) is reloaded.DecoratedPlatform
        assert current_platform() == reloaded.DecoratedPlatform()
    finally:
        unregister_platform("decorated")


def test_a_named_platform_wins_over_several_available_plugins(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    make_plugin("accel-a")
    make_plugin("accel-b")
    with pytest.raises(AmbiguousPlatformError, match="--platform"):
        current_platform()  # nothing named: detection cannot choose
    assert get_platform("accel-b").name == "accel-b"
    assert resolve("DeepseekV4ForCausalLM", "accel-a").platform.name == "accel-a"
    monkeypatch.setenv("DSV4_PLATFORM", "accel-a")  # a name given explicitly beats it too
    for name in ("accel-b", "cpu"):
        assert main(["explain", "--platform", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["platform"] == name
    run = ["run", "--platform", "accel-b", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main([*run, "--cudagraph-mode", "NONE", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["platform"] == "accel-b"
