"""``dsv4 run --checkpoint DIR`` on the published quantized layout equals transformers.

Random tiny configs (``dsv4.testing.configs``; MXFP4 needs expert sizes that are multiples of
32, so FP4 draws widen hidden and expert sizes to 32) are written in the quantized layout
(FP8 linears with float32 or ue8m0 scales under either spelling, FP8 or MXFP4 experts, BF16
compressor weights, maybe two shards), loaded by transformers 5.23.0 (CPU, float32; it
dequantizes at load) and run by ``dsv4 run --json`` in weight-only and dequantize modes in
every graph mode. Greedy tokens must equal transformers' greedy choice at every step (scored by
its uncached logits along our tokens), except where its top logits are within ``NEAR_TIE``.
Bad inputs surface as one line on stderr and exit code 1; ``init-checkpoint --quantization``
writes the layout; ``matrix`` and ``bench`` take ``--quantization`` too.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dsv4.config import DeepseekV4Config
from dsv4.quantized_writer import save_random_quantized_checkpoint
from dsv4.testing import configs, prompts
from runners.cli.main import build_parser, main
from tests.dsv4.support import hf_logits

GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
LOAD_MODES = ("weight-only", "dequantize")
NEW_TOKENS = 4
NEAR_TIE = 1e-3
FAST = ["--platform", "cpu", "--capture-sizes", "1,2", "--threads", "1", "--ignore-eos"]


def _run(argv: list[str]) -> dict[str, Any]:
    """``dsv4 … --json`` in this process: exit 0 and one JSON object on stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    assert out.getvalue().count("\n") == 1
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def _generated(directory: Path, prompt: list[int], load: str, graphs: str) -> list[int]:
    ids = ",".join(map(str, prompt))
    modes = ["--quantization", load, "--cudagraph-mode", graphs]
    where = ["--checkpoint", str(directory), "--prompt-ids", ids]
    payload = _run(["run", *where, *FAST, "--max-new-tokens", str(NEW_TOKENS), *modes])
    assert (payload["graphs"]["num_graphs"] == 0) == (graphs == "NONE")
    [output] = payload["outputs"]
    return list(output["output_ids"])


def _assert_greedy_like(hf: Any, prompt: list[int], output: list[int], label: str) -> None:
    """Each token is transformers' argmax given the tokens before it, up to a near tie."""
    logits = hf_logits(hf, prompt + output[:-1])[len(prompt) - 1 :]
    for step, (row, token) in enumerate(zip(logits, output, strict=True)):
        gap = float(row.max() - row[token])
        assert gap < NEAR_TIE, f"{label}: step {step} chose {token}, {gap:.2e} below the argmax"


@st.composite
def quantized_cases(draw: st.DrawFn, expert_dtype: str) -> tuple[DeepseekV4Config, dict[str, Any]]:
    config = draw(configs(max_layers=2))
    if expert_dtype == "fp4":
        config = attrs.evolve(config, hidden_size=32, moe_intermediate_size=32)
    layout = {
        "expert_dtype": expert_dtype,
        "scale_fmt": draw(st.sampled_from(["float", "ue8m0"])),
        "scale_suffix": draw(st.sampled_from([".scale", ".weight_scale_inv"])),
        "num_shards": draw(st.integers(1, 2)),
        "seed": draw(st.integers(0, 2**16)),
    }
    return config, layout


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
@settings(max_examples=3)
@given(data=st.data())
def test_quantized_checkpoints_run_like_transformers_in_every_mode(
    expert_dtype: str, data: st.DataObject
) -> None:
    config, layout = data.draw(quantized_cases(expert_dtype))
    prompt = data.draw(prompts(1, 12, vocab_size=config.vocab_size))
    seed = layout.pop("seed")
    with tempfile.TemporaryDirectory() as tmp:
        directory = save_random_quantized_checkpoint(tmp, config, seed, **layout)
        loaded: Any = transformers.DeepseekV4ForCausalLM.from_pretrained(
            directory, dtype=torch.float32, output_loading_info=True
        )
        hf, info = loaded
        assert not any(info.values()), info
        hf = hf.float().eval()  # REFERENCE §D quirk 2: BF16-stored tensors stay BF16
        for graphs in GRAPH_MODES:
            outputs = {load: _generated(directory, prompt, load, graphs) for load in LOAD_MODES}
            assert outputs["weight-only"] == outputs["dequantize"], graphs
            _assert_greedy_like(hf, prompt, outputs["weight-only"], graphs)


# -- bad input, init-checkpoint, the other commands ---------------------------------------------


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fp8")
    return save_random_quantized_checkpoint(
        directory, DeepseekV4Config.tiny(), 0, expert_dtype="fp8", scale_fmt="float"
    )


def _broken(source: Path, target: Path, tensors: Any = None, config: Any = None) -> Path:
    target.mkdir()
    state = load_file(str(source / "model.safetensors"))
    raw = json.loads((source / "config.json").read_text())
    if tensors is not None:
        tensors(state)
    if config is not None:
        config(raw["quantization_config"])
    save_file(state, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(raw))
    return target


BAD = [
    (
        "scale shape",
        lambda s: s.__setitem__("layers.1.attn.wq_a.scale", torch.ones(2, 1)),
        None,
        "scale of FP8 tensor 'layers.1.attn.wq_a.weight' has shape [2, 1], expected [1, 1] for a "
        "weight of shape [64, 128] with [128, 128] blocks (ceil grid) (in model.safetensors)",
    ),
    (
        "missing scale",
        lambda s: s.pop("layers.2.ffn.experts.0.w2.scale"),
        None,
        "FP8 tensor 'layers.2.ffn.experts.0.w2.weight' has no scale (expected '<weight>.scale' or "
        "'<weight>.weight_scale_inv') (in model.safetensors)",
    ),
    (
        "quant_method",
        None,
        lambda q: q.__setitem__("quant_method", "bitsandbytes"),
        "config.json quantization_config: quant_method 'bitsandbytes' is not supported "
        "(supported: 'fp8')",
    ),
    (
        "expert_dtype",
        None,
        lambda q: q.__setitem__("expert_dtype", "int4"),
        "config.json quantization_config: expert_dtype 'int4' is not supported (supported: "
        "'fp8', 'fp4')",
    ),
]


@pytest.mark.parametrize(
    ("tensors", "config", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_quantized_checkpoints_are_one_line_errors(
    fp8_checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tensors: Any,
    config: Any,
    message: str,
) -> None:
    directory = _broken(fp8_checkpoint, tmp_path / "bad", tensors, config)
    for load in ("auto", "dequantize"):
        argv = ["run", "--checkpoint", str(directory), "--prompt-ids", "1,2", "--json"]
        assert main([*argv, *FAST, "--quantization", load]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"dsv4 run: error: {message}\n"


@pytest.mark.parametrize(("layout", "piece_dtype"), [("fp8", "F8_E4M3"), ("fp8-fp4", "I8")])
def test_init_checkpoint_writes_the_quantized_layout(
    tmp_path: Path, layout: str, piece_dtype: str
) -> None:
    directory = tmp_path / layout
    payload = _run(["init-checkpoint", str(directory), "--quantization", layout, "--seed", "3"])
    assert payload["quantization"] == layout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(payload["files"])
    raw = json.loads((directory / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "fp8"
    assert raw["quantization_config"]["expert_dtype"] == ("fp4" if layout == "fp8-fp4" else "fp8")
    header = json.loads(_safetensors_header(directory / "model.safetensors"))
    assert header["layers.0.ffn.experts.0.w1.weight"]["dtype"] == piece_dtype
    assert header["layers.0.attn.wq_a.weight"]["dtype"] == "F8_E4M3"
    outputs = [
        _run(["run", "--checkpoint", str(directory), "--prompt", "hi", *FAST, "--quantization", m])
        for m in LOAD_MODES
    ]
    assert outputs[0]["outputs"] == outputs[1]["outputs"]
    assert "text" in outputs[0]["outputs"][0]


def _safetensors_header(path: Path) -> str:
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return handle.read(size).decode()


def test_matrix_and_bench_take_the_quantization(fp8_checkpoint: Path) -> None:
    parser = build_parser()
    for command in ("run", "matrix", "bench"):
        args = parser.parse_args([command, "--quantization", "dequantize"])
        assert args.quantization == "dequantize"
        assert parser.parse_args([command]).quantization == "auto"
    prompts = ["--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--capture-sizes", "1,2"]
    where = ["--checkpoint", str(fp8_checkpoint), "--platform", "cpu", "--threads", "1"]
    payload = _run(["matrix", *where, *prompts, "--quantization", "weight-only"])
    assert payload["failed_cells"] == 0
    assert payload["counts"].get("equal", 0) > 0
