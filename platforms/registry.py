"""The platform registry: built-ins, registered classes and out-of-tree plugins, looked up by name.

Out-of-tree platforms are discovered through the entry-point group ``dsv4.platforms``. An entry
point's name is the platform's name; its object is a ``Platform`` subclass or a zero-argument
callable returning a ``Platform``::

    [project.entry-points."dsv4.platforms"]
    myaccel = "myaccel_dsv4:MyAccelPlatform"

A plugin module may also decorate its class with ``@register_platform`` (as the README's
example does): the entry point and the registration then name the same platform, which is one
platform, not a collision.

Invariants:
- Discovery runs on every lookup and nothing it finds is cached: a lookup sees exactly the
  distributions installed now, and every lookup returns a fresh platform object, so no test ever
  clears a cache. Loading a plugin module twice is cheap (Python caches imports, not us).
- One name, one platform. A registration or plugin is *the same platform* as the one already
  under its name when its class is the same definition (same module and qualified name: the same
  class, or the class of a re-imported module, which replaces the old one). Anything else under a
  taken name is refused: ``PlatformRegistrationError`` for a registration,
  ``PlatformPluginError`` for a plugin.
- A plugin that fails to load, returns something that is not a ``Platform``, carries a name
  other than its entry point's or one taken by another platform, is a loud
  ``PlatformPluginError`` naming the entry point and its distribution — a broken accelerator
  plugin must not silently fall back to another device.
- A name given explicitly always wins: ``get(name)`` loads only the entry points carrying that
  name, never detects and never reads ``DSV4_PLATFORM``, so neither several available plugins
  (no ``AmbiguousPlatformError``) nor an unrelated broken plugin stops ``--platform cpu``.
- ``current()`` (nothing named) honours ``DSV4_PLATFORM`` first; otherwise it loads every plugin
  (a broken one is loud here), an available out-of-tree platform (plugin or registered class)
  wins, and two available ones are an ``AmbiguousPlatformError``; otherwise the first available
  built-in of cuda, rocm, cpu. It is computed on each call.
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


def _same_definition(a: type, b: type) -> bool:
    """True when ``a`` and ``b`` are one class definition: the same class, or the class a
    re-imported (reloaded) module defined again."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


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
        """Register a ``Platform`` subclass under its ``name``; usable as a class decorator.

        Registering the same definition again (a re-imported module) replaces it; another class
        under a taken name is a ``PlatformRegistrationError``.
        """
        name = _instantiate(cls).name
        if name in self._classes and not _same_definition(self._classes[name], cls):
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
    def plugins(self, name: str | None = None) -> dict[str, Platform]:
        """Load the plugins of the entry-point group now (only those named ``name`` if given);
        raise loudly on any broken one."""
        found: dict[str, Platform] = {}
        entry_points = metadata.entry_points(group=self.group)
        if name is not None:
            entry_points = entry_points.select(name=name)
        for ep in entry_points:
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
            taken = self._classes.get(ep.name)
            if taken is None and ep.name in found:
                taken = type(found[ep.name])
            if taken is not None and not _same_definition(taken, type(platform)):
                raise PlatformPluginError(
                    f"{origin} reuses the platform name {ep.name!r}, taken by "
                    f"{taken.__module__}.{taken.__qualname__}"
                )
            found[ep.name] = platform
        return found

    def names(self) -> tuple[str, ...]:
        """Every platform name known now, sorted (loads every plugin)."""
        plugins = self.plugins()
        return tuple(sorted({*self._classes, *plugins}))

    # -- lookup ------------------------------------------------------------------------------------
    def get(self, name: str) -> Platform:
        """A fresh platform object for ``name`` (available here or not).

        Loads only the plugins named ``name`` (a broken one is loud), so an explicit name wins
        over discovery: it never detects, never reads ``DSV4_PLATFORM`` and is never ambiguous.
        """
        plugins = self.plugins(name)
        if name in plugins:
            return plugins[name]
        if name in self._classes:
            return self._classes[name]()
        entry_point_names = metadata.entry_points(group=self.group).names
        known = ", ".join(sorted({*self._classes, *entry_point_names}))
        raise UnknownPlatformError(f"unknown platform {name!r}; registered platforms: {known}")

    def current(
        self, environ: Mapping[str, str] | None = None, *, simulated: bool = False
    ) -> Platform:
        """The platform to run on now when none is named: ``DSV4_PLATFORM``, else detection (see
        module docs). A caller holding a name calls ``get(name)`` instead. ``simulated``: the
        caller will simulate it, so a platform named by ``DSV4_PLATFORM`` need not be available
        here."""
        env = os.environ if environ is None else environ
        chosen = env.get(PLATFORM_ENV, "").strip()
        if chosen:
            platform = self.get(chosen)
            if not simulated:
                platform.require_available()
            return platform
        plugins = self.plugins()  # first: loading a plugin may register its class
        out_of_tree = {
            name: cls() for name, cls in self._classes.items() if name not in self._builtin_names
        }
        out_of_tree.update(plugins)  # a registered plugin is one platform under one name
        active = [p for p in out_of_tree.values() if p.is_available()]
        if len(active) > 1:
            names = ", ".join(sorted(p.name for p in active))
            raise AmbiguousPlatformError(
                f"several out-of-tree platforms are available ({names}); name the one to use: "
                f"set {PLATFORM_ENV} (or pass --platform to a dsv4 command)"
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
    """A fresh platform object by name; ``UnknownPlatformError`` lists the known names.

    An explicit name always wins: no detection, no ``DSV4_PLATFORM``, no ambiguity between
    plugins, and only the plugins carrying ``name`` are loaded.
    """
    return _DEFAULT.get(name)


def platform_names() -> tuple[str, ...]:
    """Every platform name the default registry knows now (built-in, registered, plugins)."""
    return _DEFAULT.names()


def current_platform(*, simulated: bool = False) -> Platform:
    """The platform to run on when none is named, decided now from ``DSV4_PLATFORM`` and the
    machine (not cached); callers holding a name (``--platform``) use ``get_platform``.
    ``simulated``: the caller runs it simulated, so ``DSV4_PLATFORM`` may name a platform this
    machine lacks."""
    return _DEFAULT.current(simulated=simulated)
