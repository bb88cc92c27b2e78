"""A model built for loading (``initialize=False``) writes none of its parameters' memory: no
float32 (or any) copy of a weight is made and then thrown away, so the load's peak is the model
it fills, not the model plus a transient copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4 import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM


class _Writes(TorchDispatchMode):
    """Records the element count of every real (non-meta) tensor an op writes: the first
    argument of an in-place op, the output of any op but ``empty`` (which writes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        written = args[0] if name.endswith("_") else None if "empty" in name else out
        if isinstance(written, torch.Tensor) and not written.is_meta:
            self.sizes.append(written.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_building_for_loading_writes_no_weight(dtype: torch.dtype) -> None:
    config = DeepseekV4Config.small()
    with _Writes() as writes:
        model = DeepseekV4ForCausalLM(config, dtype=dtype, initialize=False)
    largest = max(p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert model.model.layers[1].mlp.experts.gate_up_proj.numel() == largest
    # what is written: the buffers the modules compute and a few small zero/one initialisers
    assert max(writes.sizes) < largest / 32
    assert sum(writes.sizes) < total / 32
