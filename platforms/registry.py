"""The platform registry: built-ins, registered classes and out-of-tree plugins, looked up by name.

Out-of-tree platforms are discovered through the entry-point group ``dsv4.platforms``. An entry
point's name is the platform's name; its object is a ``Platform`` subclass or a zero-argument
callable returning a ``Platform``::

    [project.entry-points."dsv4.platforms"]
    myaccel = "myaccel_dsv4:MyAccelPlatform"

Invariants:
- Discovery runs on every lookup and nothing it finds is cached: a lookup sees exactly the
  distributions installed now, and every lookup returns a fresh platform object, so no test ever
  clears a cache. Loading a plugin module twice is cheap (Python caches imports, not us).
- A plugin that fails to load, returns something that is not a ``Platform``, or carries a name
  other than its entry point's or one already taken, is a loud ``PlatformPluginError`` naming the
  entry point and its distribution — a broken accelerator plugin must not silently fall back to
  another device.
- ``current()`` honours ``DSV4_PLATFORM`` first; otherwise an available out-of-tree platform
  (plugin or registered class) wins, and two available ones are an ``AmbiguousPlatformError``;
  otherwise the first available built-in of cuda, rocm, cpu. It is computed on each call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import TypeVar

from platforms.base import Platform
from platforms.cpu import CpuPlatform
from platforms.cuda import CudaPlatform
from platforms.errors import (
    AmbiguousPlatformError,
    PlatformPluginError,
    PlatformRegistrationError,
    UnknownPlatformError,
)
from platforms.rocm import RocmPlatform

__all__ = [
    "BUILTIN_PLATFORMS",
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV",
    "PlatformRegistry",
    "current_platform",
    "get_platform",
    "platform_names",
    "register_platform",
    "unregister_platform",
]

ENTRY_POINT_GROUP = "dsv4.platforms"
PLATFORM_ENV = "DSV4_PLATFORM"
BUILTIN_PLATFORMS: tuple[type[Platform], ...] = (CudaPlatform, RocmPlatform, CpuPlatform)

P = TypeVar("P", bound=type[Platform])


def _instantiate(cls: type[Platform]) -> Platform:
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformRegistrationError(f"{cls!r} is not a subclass of platforms.Platform")
    return cls()


class PlatformRegistry:
    """Platforms by name: built-in and registered classes plus the plugins installed now."""

    def __init__(
        self,
        builtins: Iterable[type[Platform]] = BUILTIN_PLATFORMS,
        *,
        group: str = ENTRY_POINT_GROUP,
    ) -> None:
        self.group = group
        self._classes: dict[str, type[Platform]] = {}
        self._builtin_names: list[str] = []
        for cls in builtins:
            self.register(cls)
            self._builtin_names.append(_instantiate(cls).name)

    # -- registration ------------------------------------------------------------------------------
    def register(self, cls: P) -> P:
        """Register a ``Platform`` subclass under its ``name``; usable as a class decorator."""
        name = _instantiate(cls).name
        if name in self._classes:
            raise PlatformRegistrationError(
                f"platform name {name!r} is already registered by "
                f"{self._classes[name].__qualname__}; pick another name or unregister it first"
            )
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        if name not in self._classes:
            raise UnknownPlatformError(f"platform {name!r} is not registered")
        del self._classes[name]
        if name in self._builtin_names:
            self._builtin_names.remove(name)

    # -- discovery ---------------------------------------------------------------------------------
    def plugins(self) -> dict[str, Platform]:
        """Load every plugin of the entry-point group now; raise loudly on any broken one."""
        found: dict[str, Platform] = {}
        for ep in metadata.entry_points(group=self.group):
            dist = getattr(ep, "dist", None)
            origin = f"platform plugin {ep.name!r} ({ep.value}"
            origin += f", distribution {dist.name})" if dist is not None else ")"
            try:
                obj = ep.load()
                platform = _instantiate(obj) if isinstance(obj, type) else _call(obj)
            except Exception as exc:
                raise PlatformPluginError(
                    f"{origin} failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            if platform.name != ep.name:
                raise PlatformPluginError(
                    f"{origin} provides a platform named {platform.name!r}; "
                    "the entry point must carry the platform's name"
                )
            if ep.name in self._classes or ep.name in found:
                raise PlatformPluginError(f"{origin} reuses the taken platform name {ep.name!r}")
            found[ep.name] = platform
        return found

    def names(self) -> tuple[str, ...]:
        """Every platform name known now, sorted."""
        return tuple(sorted([*self._classes, *self.plugins()]))

    # -- lookup ------------------------------------------------------------------------------------
    def get(self, name: str) -> Platform:
        """A fresh platform object for ``name`` (available here or not)."""
        plugins = self.plugins()  # always: a broken plugin is loud on every lookup
        if name in self._classes:
            return self._classes[name]()
        if name in plugins:
            return plugins[name]
        known = ", ".join(sorted([*self._classes, *plugins]))
        raise UnknownPlatformError(f"unknown platform {name!r}; registered platforms: {known}")

    def current(self, environ: Mapping[str, str] | None = None) -> Platform:
        """The platform to run on now: ``DSV4_PLATFORM``, else detection (see module docs)."""
        env = os.environ if environ is None else environ
        chosen = env.get(PLATFORM_ENV, "").strip()
        if chosen:
            platform = self.get(chosen)
            platform.require_available()
            return platform
        out_of_tree = [
            *(cls() for name, cls in self._classes.items() if name not in self._builtin_names),
            *self.plugins().values(),
        ]
        active = [p for p in out_of_tree if p.is_available()]
        if len(active) > 1:
            names = ", ".join(sorted(p.name for p in active))
            raise AmbiguousPlatformError(
                f"several out-of-tree platforms are available ({names}); "
                f"set {PLATFORM_ENV} to the one to use"
            )
        if active:
            return active[0]
        for name in self._builtin_names:
            platform = self._classes[name]()
            if platform.is_available():
                return platform
        raise UnknownPlatformError(
            f"no registered platform is available on this machine; set {PLATFORM_ENV}"
        )


def _call(factory: Callable[[], object]) -> Platform:
    result = factory()
    if not isinstance(result, Platform):
        raise TypeError(f"the factory returned {result!r}, not a platforms.Platform")
    return result


_DEFAULT = PlatformRegistry()


def register_platform(cls: P) -> P:
    """Register a ``Platform`` subclass in the default registry (usable as a decorator)."""
    return _DEFAULT.register(cls)


def unregister_platform(name: str) -> None:
    """Remove a platform registered with ``register_platform`` from the default registry."""
    _DEFAULT.unregister(name)


def get_platform(name: str) -> Platform:
    """A fresh platform object by name; ``UnknownPlatformError`` lists the known names."""
    return _DEFAULT.get(name)


def platform_names() -> tuple[str, ...]:
    """Every platform name the default registry knows now (built-in, registered, plugins)."""
    return _DEFAULT.names()


def current_platform() -> Platform:
    """The platform to run on, decided now from ``DSV4_PLATFORM`` and the machine (not cached)."""
    return _DEFAULT.current()
