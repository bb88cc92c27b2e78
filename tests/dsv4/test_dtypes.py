"""Compute dtypes of the model: what stays float32 (transformers' list), what ``auto`` means,
and loading straight into the target dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM, load_checkpoint
from dsv4.dtypes import KEEP_IN_FP32_MODULES, keeps_float32, resolve_dtype
from dsv4.errors import ConfigError
from dsv4.hf_config import save_config
from dsv4.testing import run_schedule
from dsv4.weights import randomize_

PROMPT = list(range(3, 40))


def test_the_float32_list_is_transformers_strict_list() -> None:
    strict = transformers.DeepseekV4ForCausalLM._keep_in_fp32_modules_strict
    assert list(KEEP_IN_FP32_MODULES) == list(strict)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tied", [False, True])
def test_a_model_built_for_loading_has_every_parameter_in_its_final_dtype(
    dtype: torch.dtype, tied: bool
) -> None:
    config = attrs.evolve(DeepseekV4Config.tiny(), tie_word_embeddings=tied)
    empty = DeepseekV4ForCausalLM(config, dtype=dtype, initialize=False)
    built = DeepseekV4ForCausalLM(config, dtype=dtype)
    shapes = {n: (p.shape, p.dtype) for n, p in built.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in empty.named_parameters()} == shapes
    assert all(not p.is_meta and not p.requires_grad for p in empty.parameters())
    kept = {n for n, p in empty.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n, _ in empty.named_parameters() if keeps_float32(n)}
    assert {n.split(".")[-2] for n in kept} >= {"q_a_norm", "kv_norm", "norm", "attn_hc"}
    assert empty.compute_dtype == dtype
    assert (empty.lm_head.weight is empty.model.embed_tokens.weight) == tied
    for (name, a), (_, b) in zip(empty.named_buffers(), built.named_buffers(), strict=True):
        assert torch.equal(a, b), name  # buffers (RoPE tables, index tables) are computed


def _bfloat16_checkpoint(directory: Path, seed: int = 2) -> Path:
    """A checkpoint as transformers saves a bfloat16 model: compute-dtype weights in bfloat16,
    the fp32-kept ones in float32, ``torch_dtype: bfloat16`` in config.json."""
    config = DeepseekV4Config.tiny()
    model = DeepseekV4ForCausalLM(config, dtype=torch.bfloat16)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    directory.mkdir(parents=True, exist_ok=True)
    save_config(directory, config)
    _edit_config(directory, torch_dtype="bfloat16")
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def _edit_config(directory: Path, **fields: Any) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


class _Conversions(TorchDispatchMode):
    """Every float32 -> narrower-float conversion (a cast or a copy across dtypes) run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        source = args[1] if name.startswith("copy_") else args[0]
        result = args[0] if name.startswith("copy_") else out
        if (
            name.startswith(("_to_copy", "copy_"))
            and isinstance(source, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and source.dtype == torch.float32
            and result.dtype in (torch.bfloat16, torch.float16)
        ):
            self.seen.append((name, list(source.shape)))
        return out


def test_loading_converts_nothing_through_float32(tmp_path: Path) -> None:
    """A bfloat16 checkpoint loads into bfloat16 without one float32 -> bfloat16 conversion: no
    parameter is first made (or filled) in float32 and cast down."""
    checkpoint = _bfloat16_checkpoint(tmp_path)
    with _Conversions() as conversions:
        model = load_checkpoint(checkpoint, dtype=torch.bfloat16)
    assert conversions.seen == []
    assert model.compute_dtype == torch.bfloat16
    # and it is the model transformers loads from the same file in bfloat16
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert {n for n, p in hf.named_parameters() if p.dtype == torch.float32} == {
        n for n, p in model.named_parameters() if p.dtype == torch.float32
    }
    ours = run_schedule(model, [PROMPT], [[(0, 20)], [(0, 17)]])[0]
    expected = transformers_logits(hf, PROMPT)
    assert float((ours - expected).abs().max()) <= 0.1


def transformers_logits(hf: transformers.DeepseekV4ForCausalLM, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.eval()(torch.tensor([prompt]), use_cache=False).logits[0].float()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, torch.float32),
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "float16"}, torch.float16),  # the key transformers 5 writes
        ({"torch_dtype": None, "dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "torch.float16"}, torch.float16),
    ],
)
def test_auto_is_the_checkpoint_torch_dtype(
    tmp_path: Path, fields: dict[str, Any], expected: torch.dtype
) -> None:
    save_config(tmp_path, DeepseekV4Config.tiny())
    _edit_config(tmp_path, **fields)
    assert resolve_dtype("auto", tmp_path) == expected
    assert resolve_dtype("float32", tmp_path) == torch.float32  # an explicit dtype wins
    assert resolve_dtype("auto", None) == torch.float32  # the built-in model


def test_auto_refuses_a_dtype_that_is_not_a_compute_dtype(tmp_path: Path) -> None:
    save_config(tmp_path, DeepseekV4Config.tiny())
    _edit_config(tmp_path, torch_dtype="float64")
    with pytest.raises(ConfigError, match=r"torch_dtype 'float64'.*--dtype"):
        resolve_dtype("auto", tmp_path)
    with pytest.raises(ValueError, match="not one of auto, float32, bfloat16, float16"):
        resolve_dtype("half", tmp_path)
    with pytest.raises(ValueError, match="floating dtype"):
        DeepseekV4ForCausalLM(DeepseekV4Config.tiny(), dtype=torch.int32)
