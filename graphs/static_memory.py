"""``StaticMemory``: the memory a capture may read without having produced it.

Replay reads whatever the captured addresses hold at replay time, so a captured segment may
only read memory that stays put and is rewritten in place between replays: the runner's input
buffers, persistent attention metadata, KV caches, and the model's weights. The runner declares
that memory here; the capture audit (``graphs.audit``) reports every other read.

Invariants:
- Registration is by storage: a registered tensor covers every view of its storage.
- The registry holds registered tensors strongly (a storage's identity is its address, which
  must not be reused while registered) and resolves registered modules' parameters and buffers
  when a capture starts, so weights swapped in after registration are covered.
- Registering anything but a tensor (or, for ``register_module``, a module) raises ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from graphs._tensor_refs import storage_key

__all__ = ["StaticMemory"]


class StaticMemory:
    """A registry of static memory: named tensors and whole modules."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[torch.Tensor, str]] = {}
        self._modules: list[tuple[torch.nn.Module, str]] = []

    def register(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Declare ``tensor``'s storage static under ``name``; returns ``tensor``."""
        if not isinstance(tensor, torch.Tensor):
            hint = (
                "; use register_module for a module" if isinstance(tensor, torch.nn.Module) else ""
            )
            raise TypeError(
                f"static memory must be a torch.Tensor, got {type(tensor).__name__}{hint}"
            )
        label = name if name is not None else f"static tensor {tuple(tensor.shape)}"
        self._tensors.setdefault(storage_key(tensor), (tensor, label))
        return tensor

    def register_many(self, tensors: Iterable[torch.Tensor], prefix: str) -> None:
        """Register each tensor as ``prefix[i]`` (e.g. every KV-cache tensor of a model)."""
        for i, tensor in enumerate(tensors):
            self.register(tensor, f"{prefix}[{i}]")

    def register_module(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Declare every parameter and buffer of ``module`` static (resolved at capture start)."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"register_module needs a torch.nn.Module, got {type(module).__name__}")
        self._modules.append((module, prefix))

    def storages(self) -> dict[int, str]:
        """Storage key -> name of everything registered, modules resolved as of now."""
        resolved: dict[int, str] = {}
        for module, prefix in self._modules:
            named = (*module.named_parameters(prefix), *module.named_buffers(prefix))
            for name, tensor in named:
                resolved.setdefault(storage_key(tensor), name)
        resolved.update((key, name) for key, (_, name) in self._tensors.items())
        return resolved

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The name ``tensor``'s storage is registered under, or ``None``."""
        return self.storages().get(storage_key(tensor))

    def __contains__(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and self.name_of(tensor) is not None

    def __len__(self) -> int:
        return len(self.storages())

    def __repr__(self) -> str:
        return f"StaticMemory(tensors={len(self._tensors)}, modules={len(self._modules)})"
