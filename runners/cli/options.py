"""Option groups shared by several commands, and parsing of their values."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from dsv4.dtypes import DTYPE_CHOICES
from graphs import STRATEGIES
from platforms.device_only_group import DEVICE_ONLY_GLOO
from runners.base import DEFAULT_MAX_GRAPH_CONTEXTS
from runners.batch import DEFAULT_CAPTURE_SIZES, DEFAULT_FIRST_CONTEXT_BUCKET
from runners.capacity import DEFAULT_MEMORY_FRACTION
from runners.cli.errors import UsageError
from runners.cli.values import at_least, byte_count, probability
from runners.distributed import process_group_backend
from runners.modes import CUDAGraphMode
from runners.resolution import RUNNERS
from runners.spec import resolve_platform

__all__ = [
    "DTYPE_CHOICES",
    "EAGER_REGION_CHOICES",
    "MODE_CHOICES",
    "PLATFORM_HELP",
    "QUANTIZATION_CHOICES",
    "RUNNER_CHOICES",
    "SIMULATE_HELP",
    "add_capacity_options",
    "add_dtype_option",
    "add_model_options",
    "add_parallel_option",
    "add_policy_options",
    "add_quantization_option",
    "capacity_fields",
    "parallel_backend",
    "parse_int_list",
    "parse_positive_int_list",
    "parse_token_ids",
]

RUNNER_CHOICES = ("auto", *RUNNERS)
MODE_CHOICES = ("auto", *(mode.name for mode in CUDAGraphMode))
EAGER_REGION_CHOICES = ("auto", *(region.name for region in STRATEGIES))
PLATFORM_HELP = "platform name (cuda, rocm, cpu or a plugin's); default: the current platform"
SIMULATE_HELP = "run the platform's policy on the CPU with the tape backend"
QUANTIZATION_CHOICES = ("auto", "weight-only", "dequantize")


def add_policy_options(parser: argparse.ArgumentParser, *, platform_required: bool) -> None:
    """Options that steer the resolution of runner, graph mode and eager region."""
    group = parser.add_argument_group("resolution")
    group.add_argument(
        "--platform",
        required=platform_required,
        help="platform name (cuda, rocm, cpu or a plugin's); required"
        if platform_required
        else PLATFORM_HELP,
    )
    group.add_argument(
        "--runner", default="auto", choices=RUNNER_CHOICES, help="model runner (default: auto)"
    )
    group.add_argument(
        "--cudagraph-mode",
        default="auto",
        choices=MODE_CHOICES,
        help="graph mode (default: auto = FULL_AND_PIECEWISE, downgraded where unsafe)",
    )
    group.add_argument(
        "--eager-region",
        default="auto",
        choices=EAGER_REGION_CHOICES,
        help="eager region of each attention layer (default: auto = the narrowest safe one)",
    )
    group.add_argument(
        "--unsafe-region",
        action="store_true",
        help="allow a region narrower than the runner requires (experiments; the capture "
        "audit then reports the unstable reads)",
    )


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Where the model comes from and how it is run."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="Hugging Face-layout checkpoint (config.json + *.safetensors); "
        "default: the built-in tiny model with fixed-seed weights",
    )
    group.add_argument("--simulate", action="store_true", help=SIMULATE_HELP)
    add_dtype_option(group)
    add_quantization_option(group)
    group.add_argument(
        "--capture-sizes",
        type=parse_positive_int_list,
        default=None,
        metavar="N,N,...",
        help="token counts to capture graphs for (default: 1,2,4,8,16,32)",
    )
    group.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch CPU threads (default: 1 up to hidden size 512, else one per core)",
    )
    add_capacity_options(parser)
    add_parallel_option(parser)


def add_capacity_options(parser: argparse.ArgumentParser) -> None:
    """How long requests may be, how many run at once, and how much KV memory they get
    (``EngineSpec``'s capacity fields, ``runners.capacity``)."""
    group = parser.add_argument_group("capacity")
    group.add_argument(
        "--max-model-len",
        type=at_least(1),
        default=None,
        metavar="TOKENS",
        help="longest request, prompt and output together (default: the checkpoint's "
        "max_position_embeddings, capped by the KV budget with a note)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=at_least(1),
        default=16,
        metavar="N",
        help="requests in flight at once (default: 16)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=at_least(1),
        default=None,
        metavar="N",
        help="tokens one step may carry (default: 64, or the largest capture size if larger)",
    )
    group.add_argument(
        "--block-size", type=at_least(1), default=16, metavar="TOKENS", help="default: 16"
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of equal prompt prefixes between requests, so a repeated "
        "prefix is computed once (default: on; --no-enable-prefix-caching turns it off)",
    )
    budget = group.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-cache-memory",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="KV cache budget in bytes (512MiB, 4GiB, ... accepted)",
    )
    budget.add_argument(
        "--memory-fraction",
        type=probability,
        default=None,
        metavar="F",
        help="KV cache budget as a share of the device's free memory after loading "
        f"(default: {DEFAULT_MEMORY_FRACTION}, at most 4 GiB on the CPU)",
    )
    group.add_argument(
        "--first-context-bucket",
        type=at_least(1),
        default=None,
        metavar="TOKENS",
        help="context the smallest graphs cover; each next bucket doubles up to "
        f"--max-model-len (default: {DEFAULT_FIRST_CONTEXT_BUCKET})",
    )
    group.add_argument(
        "--max-graph-contexts",
        type=at_least(1),
        default=None,
        metavar="N",
        help="context buckets graphs are held for; steps in others run eagerly at their "
        f"exact context (default: {DEFAULT_MAX_GRAPH_CONTEXTS})",
    )


def add_parallel_option(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``: the ranks a run is split across (``runners.distributed``)."""
    parser.add_argument_group("parallelism").add_argument(
        "--tensor-parallel-size",
        type=at_least(1),
        default=1,
        metavar="N",
        help="split the model across N local worker processes (torch.distributed: gloo on the "
        "CPU, nccl on GPUs); under torchrun, the world torchrun started (default: 1)",
    )


def parallel_backend(names: Sequence[str | None], *, simulate: bool) -> str:
    """The process-group backend of the platforms ``names`` (``None``: the current one) a
    command runs on: ``gloo`` where they run on the CPU (simulated or not available here;
    refusing host tensors if any of them must, ``process_group_backend``), else the platform's
    own; one line (exit 2) when a command would mix them."""
    backends = set()
    for name in names:
        backends.add(process_group_backend(resolve_platform(name, simulated=simulate)))
    if backends == {"gloo", DEVICE_ONLY_GLOO}:  # CPU ranks: refuse host tensors if any must
        backends = {DEVICE_ONLY_GLOO}
    if len(backends) > 1:
        raise UsageError(
            f"--tensor-parallel-size runs one process group; these platforms need "
            f"{' and '.join(sorted(backends))}: cover them in separate runs"
        )
    return backends.pop()


def capacity_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineSpec`` fields of the capacity options (and the token budget, at least the
    largest capture size)."""
    sizes = getattr(args, "capture_sizes", None) or DEFAULT_CAPTURE_SIZES
    tokens = args.max_num_batched_tokens
    if tokens is None:
        tokens = max(64, *sizes)
    elif tokens < max(sizes):
        raise UsageError(
            f"--max-num-batched-tokens {tokens} is below the largest capture size {max(sizes)}"
        )
    buckets = {
        name: getattr(args, name)
        for name in ("first_context_bucket", "max_graph_contexts")
        if getattr(args, name) is not None
    }
    return {
        **buckets,
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_num_tokens": tokens,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_memory": args.kv_cache_memory,
        "memory_fraction": args.memory_fraction,
    }


def add_dtype_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--dtype``: the compute dtype (``EngineSpec.dtype``; choices from ``dsv4.dtypes``)."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute dtype of activations, KV caches and weights (the weights transformers "
        "keeps in float32 stay float32); default: auto = the checkpoint's torch_dtype "
        "(float32 for the built-in model or when config.json has none)",
    )


def add_quantization_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--quantization``: how a quantized checkpoint loads (``EngineSpec.quantization``)."""
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="a quantized (FP8/MXFP4) checkpoint's weights: weight-only keeps the quantized "
        "bytes resident and dequantizes in each matmul, dequantize expands them at load "
        "(default: auto = weight-only); a plain checkpoint ignores it",
    )


def parse_int_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; anything else is a usage error naming the bad item."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    try:
        return [int(item) for item in items]
    except ValueError:
        bad = next(item for item in items if not item.lstrip("-").isdigit())
        raise argparse.ArgumentTypeError(f"{bad!r} is not an integer (in {text!r})") from None


def _int_list_at_least(minimum: int, rule: str) -> Callable[[str], list[int]]:
    """A ``parse_int_list`` whose every value is ``>= minimum``; ``rule`` words the refusal."""

    def parse(text: str) -> list[int]:
        values = parse_int_list(text)
        bad = [v for v in values if v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"{rule}, got {bad[0]} (in {text!r})")
        return values

    return parse


parse_positive_int_list = _int_list_at_least(1, "values must be >= 1")
"""``parse_int_list`` whose every value is ``>= 1`` (sizes, counts)."""
parse_token_ids = _int_list_at_least(0, "token ids are >= 0")
"""``parse_int_list`` whose every value is a token id (``>= 0``)."""
