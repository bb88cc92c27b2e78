"""Checkpoints: what transformers writes loads into ours (and back), bad ones fail in one line."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.checkpoint import TensorValueError, load_checkpoint, save_random_checkpoint
from dsv4.config import DeepseekV4Config
from dsv4.errors import CheckpointError, ConfigError
from dsv4.hf_config import UnsupportedArchitectureError, save_config
from dsv4.testing import configs, random_model, run_schedule
from tests.dsv4.support import hf_logits, hf_twin

PROMPT = list(range(1, 38))  # below every test vocabulary (64)


def _ours(model_dir: Path) -> torch.Tensor:
    return run_schedule(load_checkpoint(model_dir), [PROMPT], [[(0, len(PROMPT))]])[0]


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny random model saved by ``save_pretrained``, and its reference logits."""
    hf = hf_twin(random_model(DeepseekV4Config.tiny(), 21))
    directory = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(directory)
    return directory, hf_logits(hf, PROMPT)


def test_save_pretrained_checkpoint_loads_with_equal_logits(
    hf_saved: tuple[Path, torch.Tensor],
) -> None:
    directory, expected = hf_saved
    assert (_ours(directory) - expected).abs().max() <= 1e-4


@settings(max_examples=6)
@given(config=configs(), seed=st.integers(0, 2**16))
def test_save_pretrained_of_random_configs_loads_with_equal_logits(
    config: DeepseekV4Config, seed: int
) -> None:
    hf = hf_twin(random_model(config, seed))
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        ours = run_schedule(load_checkpoint(directory), [PROMPT], [[(0, len(PROMPT))]])[0]
    assert (ours - hf_logits(hf, PROMPT)).abs().max() <= 1e-4


def _rewrite(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a checkpoint, letting ``edit`` change its tensors (one safetensors file)."""
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(path))
    return target


def _official(tensors: dict[str, torch.Tensor]) -> None:
    """The mix save_pretrained writes -> the official layout (no ``model.`` prefix)."""
    renames = {"embed_tokens.weight": "embed.weight"}
    renames.update({f"hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")})
    for key in list(tensors):
        bare = key.removeprefix("model.")
        tensors[renames.get(bare, bare)] = tensors.pop(key)
    tensors["mtp.0.some.weight"] = torch.zeros(2)


def test_official_names_load_with_equal_logits(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    directory, expected = hf_saved
    official = _rewrite(directory, tmp_path / "official", _official)
    with safe_open(str(official / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"embed.weight", "head.weight", "layers.1.attn.indexer.wq_b.weight"} <= names
    assert "layers.0.ffn.experts.3.w2.weight" in names
    assert (_ours(official) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_random_checkpoint_loads_in_transformers_and_ours(tmp_path: Path, tied: bool) -> None:
    config = attrs.evolve(DeepseekV4Config.tiny(), tie_word_embeddings=tied)
    save_random_checkpoint(tmp_path, config, seed=5)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    assert (_ours(tmp_path) - hf_logits(hf, PROMPT)).abs().max() <= 1e-4
    again = tmp_path / "again"
    save_random_checkpoint(again, config, seed=5)
    assert torch.equal(_ours(again), _ours(tmp_path))


def test_bfloat16_model_equals_transformers_in_bfloat16(tmp_path: Path) -> None:
    """Weights the reference keeps in fp32 stay fp32 here too, and rounding happens where the
    reference rounds, so the two bf16 models agree: within two bf16 units of the largest logit
    and much closer than float32 is. Not packed in panels, the products are ATen's as
    transformers' are; attention and pooling round where they round (docs/design.md, "Narrow
    dtypes on the float32 kernels"). (Seed 0 agrees bit for bit on AVX-512; ATen's bf16
    kernels under AVX2 move it by 0.016. Of seeds 0-5, 1 and 4 differ from one position on by
    up to 0.031, half float32's distance: an open question, docs/testing.md.)"""
    save_random_checkpoint(tmp_path, DeepseekV4Config.tiny(), seed=0)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    hf_fp32 = {n for n, p in hf.named_parameters() if p.dtype == torch.float32}
    assert hf_fp32 == {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    logits = run_schedule(ours, [PROMPT], [[(0, len(PROMPT))]])[0].float()
    reference = hf_logits(hf.eval(), PROMPT).float()
    unit = 2.0 ** (math.floor(math.log2(float(reference.abs().max()))) - 7)
    assert float((logits - reference).abs().max()) <= 2 * unit
    full = load_checkpoint(tmp_path, dtype=torch.float32)
    float32 = run_schedule(full, [PROMPT], [[(0, len(PROMPT))]])[0]
    assert (logits - reference).abs().max() < (float32 - reference).abs().max() / 2


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return edit


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, value)


def _fp8(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, tensors[name].to(torch.float8_e4m3fn))


def _poke(
    name: str, index: tuple[int, ...], value: float
) -> Callable[[dict[str, torch.Tensor]], None]:
    """Set one entry of a tensor (a corrupt weight, a router table pointing nowhere)."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name][index] = value

    return edit


_DTYPES = "expected one of ['BF16', 'F16', 'F32', 'F64']"
_INTS = "expected one of ['I16', 'I32', 'I64', 'U16', 'U32']"
_UNQUANTIZED = "(quantized, but config.json has no quantization_config)"

BAD_TENSORS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    (
        "missing",
        _drop("model.layers.0.attn.attn_sink"),
        "checkpoint {directory} is missing tensor 'model.layers.0.self_attn.sinks'",
    ),
    (
        "unexpected",
        _set("model.layers.0.attn.bogus.weight", torch.zeros(2)),
        "unexpected tensor 'model.layers.0.attn.bogus.weight' in model.safetensors",
    ),
    (
        "mis-shaped",
        _set("model.layers.1.attn.compressor.ape", torch.zeros(3, 3)),
        "tensor 'model.layers.1.attn.compressor.ape' in model.safetensors has shape [3, 3], "
        "expected [4, 64]",
    ),
    (
        "fp8",
        _fp8("model.layers.2.attn.wq_a.weight"),
        f"tensor 'model.layers.2.attn.wq_a.weight' in model.safetensors is F8_E4M3 {_UNQUANTIZED}; "
        f"{_DTYPES}",
    ),
    (
        "fp4 packed",
        _set("model.layers.0.ffn.experts.1.w1.weight", torch.zeros(64, 64, dtype=torch.uint8)),
        "tensor 'model.layers.0.ffn.experts.1.w1.weight' in model.safetensors is U8 "
        f"{_UNQUANTIZED}; {_DTYPES}",
    ),
    (
        "scale",
        _set("model.layers.0.attn.wkv.scale", torch.ones(1)),
        "tensor 'model.layers.0.attn.wkv.scale' in model.safetensors is a quantization scale, but "
        "config.json has no quantization_config",
    ),
    (
        "missing expert",
        _drop("model.layers.2.ffn.experts.3.w3.weight"),
        "checkpoint {directory} is missing tensor 'model.layers.2.mlp.experts.3.w3.weight'",
    ),
    (
        "float hash table",
        _set("model.layers.0.ffn.gate.tid2eid", torch.zeros(320, 2)),
        f"tensor 'model.layers.0.ffn.gate.tid2eid' in model.safetensors is F32; {_INTS}",
    ),
    (
        "NaN weight",
        _poke("model.layers.0.attn.wq_a.weight", (5, 7), float("nan")),
        "tensor 'model.layers.0.attn.wq_a.weight' in model.safetensors has non-finite values "
        "(NaN or inf): 1 of 8192, the first nan at index [5, 7]; the weights are corrupt",
    ),
    (
        "inf in one expert",
        _poke("model.layers.1.ffn.experts.2.w2.weight", (0, 3), float("-inf")),
        "tensor 'model.layers.1.ffn.experts.2.w2.weight' in model.safetensors has non-finite "
        "values (NaN or inf): 1 of 8192, the first -inf at index [0, 3]; the weights are corrupt",
    ),
    (
        "NaN fp32 buffer",
        _poke("model.layers.1.ffn.gate.bias", (2,), float("nan")),
        "tensor 'model.layers.1.ffn.gate.bias' in model.safetensors has non-finite values "
        "(NaN or inf): 1 of 4, the first nan at index [2]; the weights are corrupt",
    ),
    (
        "expert id too large",
        _poke("model.layers.0.ffn.gate.tid2eid", (17, 1), 4),
        "tensor 'model.layers.0.ffn.gate.tid2eid' in model.safetensors holds expert id 4 at index "
        "[17, 1] (token 17); expert ids must be in 0..3 (n_routed_experts=4)",
    ),
    (
        "negative expert id",
        _poke("model.layers.0.ffn.gate.tid2eid", (0, 0), -1),
        "tensor 'model.layers.0.ffn.gate.tid2eid' in model.safetensors holds expert id -1 at "
        "index [0, 0] (token 0); expert ids must be in 0..3 (n_routed_experts=4)",
    ),
]
"""Each broken checkpoint and its whole error message: the tensor as the file names it and the
file (the checkpoint directory for a tensor no file holds)."""


@pytest.mark.parametrize(
    ("edit", "message"), [b[1:] for b in BAD_TENSORS], ids=[b[0] for b in BAD_TENSORS]
)
def test_bad_tensors_give_one_line_errors_naming_the_tensor_and_file(
    hf_saved: tuple[Path, torch.Tensor],
    tmp_path: Path,
    edit: Callable[[dict[str, torch.Tensor]], None],
    message: str,
) -> None:
    directory = _rewrite(hf_saved[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory)
    assert str(error.value) == message.format(directory=directory)


def test_value_errors_carry_the_tensor_file_and_reason(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    name = "model.layers.2.ffn.gate.weight"
    directory = _rewrite(hf_saved[0], tmp_path / "nan", _poke(name, (1, 1), float("inf")))
    with pytest.raises(TensorValueError) as error:
        load_checkpoint(directory)
    assert (error.value.tensor, error.value.file) == (name, "model.safetensors")
    assert error.value.reason.startswith("has non-finite values (NaN or inf): 1 of 512")
    assert isinstance(error.value, CheckpointError)


def test_a_weight_that_overflows_the_requested_dtype_is_refused(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    name = "model.layers.0.attn.wkv.weight"
    directory = _rewrite(hf_saved[0], tmp_path / "big", _poke(name, (3, 2), 1e6))
    load_checkpoint(directory)  # fine in float32
    with pytest.raises(TensorValueError, match=r"overflow float16: 1 of \d+, the first 1e\+06 at"):
        load_checkpoint(directory, dtype=torch.float16)


def test_hash_tables_in_other_integer_dtypes_are_range_checked(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    name = "model.layers.0.ffn.gate.tid2eid"

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(torch.int32)

    fine = _rewrite(hf_saved[0], tmp_path / "int32", narrow)
    assert (_ours(fine) - hf_saved[1]).abs().max() <= 1e-4
    table = load_checkpoint(fine).model.layers[0].mlp.gate.tid2eid
    bad = _rewrite(fine, tmp_path / "int32-bad", _poke(name, (9, 0), 7))
    with pytest.raises(TensorValueError, match=r"expert id 7 at index \[9, 0\]"):
        load_checkpoint(bad)
    assert table.dtype == torch.int64 and int(table.max()) < 4


def test_a_checkpoint_of_another_architecture_is_refused(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    directory = _rewrite(hf_saved[0], tmp_path / "llama", lambda tensors: None)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV4ForCausalLM"]
    (directory / "config.json").write_text(
        json.dumps({**raw, "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(UnsupportedArchitectureError) as error:
        load_checkpoint(directory)
    assert str(error.value) == (
        "config.json names architecture 'LlamaForCausalLM', which this library does not "
        "implement (supported: DeepseekV4ForCausalLM)"
    )


def test_bad_directories_give_one_line_errors(
    hf_saved: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert str(error.value) == f"no config.json in checkpoint directory {tmp_path}"
    save_config(tmp_path, DeepseekV4Config.tiny())
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert str(error.value) == f"no *.safetensors files in checkpoint directory {tmp_path}"
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert str(error.value).startswith("cannot read model.safetensors: ")
    assert "\n" not in str(error.value)
    bad_config = _rewrite(hf_saved[0], tmp_path / "bad-config", lambda tensors: None)
    raw = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps({**raw, "o_groups": 3}))
    with pytest.raises(ConfigError, match="divisible by o_groups"):
        load_checkpoint(bad_config)


def test_the_small_preset_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    """The benchmark preset is a valid DeepSeek-V4 model, not only a valid config of ours."""
    save_random_checkpoint(tmp_path, DeepseekV4Config.small(), seed=3)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    assert (_ours(tmp_path) - hf_logits(hf, PROMPT)).abs().max() <= 1e-4
