"""From a description of a run to a working engine: model, resolution, runner and ``LLM``.

``EngineSpec`` is what a user chooses (checkpoint, platform, runner, mode, region, sizes);
``build_engine`` turns it into an ``Engine`` — the resolved policy, the runner executing it and
the ``LLM`` driving the runner. ``build_runner`` is its middle step: the runner a resolution
chose, over a given model. The CLI, the cross-strategy property suite and the platform
conformance kit all build engines this way, so they exercise exactly what users run.

Invariants:
- The resolution is computed before anything is allocated: a refused region, an unknown name,
  a checkpoint of an architecture this library does not implement or a compute dtype the
  platform's device cannot compute in (``UnsupportedDtypeError``) fails fast, with nothing
  half-built.
- The model is built in ``spec.dtype`` (``compute_dtype_of``); the runner's KV caches follow the
  model's ``compute_dtype``, so an engine over a given model runs in that model's dtype.
- The ``LLM`` stops every request at the checkpoint's EOS ids (``eos_token_id`` of
  ``config.json`` and ``generation_config.json``) unless it sets ``ignore_eos``, and decodes
  text with the checkpoint's tokenizer (byte-level for the built-in model: ``runners.text``).
- Building changes nothing in the model but its device (``build_engine`` moves it to the
  platform's): each runner owns its caches and eager region and hands them to the model in every
  step's forward context. So a model may be shared by several engines on one device
  (``build_engine(spec, model=...)``), which may run in turn in any order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM, load_checkpoint
from dsv4.config import ARCHITECTURE
from dsv4.dtypes import COMPUTE_DTYPES, DTYPE_CHOICES, dtype_name, resolve_dtype
from dsv4.generation_config import stop_token_ids
from dsv4.hf_config import checkpoint_architecture, load_config
from dsv4.panels import pack_model
from dsv4.parallel import SINGLE, TensorParallel, check_parallel_size
from dsv4.quantized_loading import LOAD_MODES
from dsv4.sharding import shard_model
from dsv4.weights import randomize_
from graphs.audit import AUDIT_MODES, AuditMode
from platforms import Platform, current_platform, get_platform, simulate
from runners.base import DEFAULT_MAX_GRAPH_CONTEXTS, ModelRunner
from runners.batch import DEFAULT_CAPTURE_SIZES, DEFAULT_FIRST_CONTEXT_BUCKET
from runners.capacity import Capacity, CapacityPlan, MaxModelLenCappedWarning
from runners.engine import LLM, StepExecutor
from runners.errors import ParallelSizeError, SpecError, UnsupportedDtypeError
from runners.layout import CacheLayout
from runners.resolution import Resolution, resolve
from runners.text import tokenizer_of
from runners.threads import apply_threads

__all__ = [
    "Engine",
    "EngineSpec",
    "architecture_of",
    "build_engine",
    "build_model",
    "build_runner",
    "capacity_of",
    "check_spec",
    "compute_dtype_of",
    "config_of",
    "llm_of",
    "parallel_of",
    "require_dtype",
    "resolve_platform",
    "resolve_spec",
]


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator refusing a value outside ``choices`` with a one-line ``SpecError``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise SpecError(
                f"EngineSpec.{attribute.name} {value!r} is not one of: {', '.join(choices)}"
            )

    return check


def _positive_or_none(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecError(f"EngineSpec.{attribute.name} must be a positive integer, got {value!r}")


def _a_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"EngineSpec.{attribute.name} must be True or False, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineSpec:
    """Everything a user chooses about a run; ``"auto"`` leaves the choice to the resolution."""

    checkpoint: Path | None = None
    """Hugging Face-layout checkpoint; ``None`` for the built-in tiny model."""
    builtin_seed: int = 0
    """Weight seed of the built-in tiny model."""
    dtype: str = attrs.field(default="auto", validator=_one_of(DTYPE_CHOICES))
    """Compute dtype: ``auto`` (the checkpoint's ``torch_dtype``; float32 for the built-in model
    or when absent), ``float32``, ``bfloat16`` or ``float16`` (``dsv4.dtypes``)."""
    platform: str | Platform | None = None
    """A platform object or registered name; ``None`` for the current platform."""
    simulate: bool = False
    """Run the platform's policy on the CPU with the tape backend."""
    runner: str = "auto"
    cudagraph_mode: str = "auto"
    eager_region: str = "auto"
    unsafe_region: bool = False
    tensor_parallel_size: int = 1
    """Ranks the model is split over (``resolve``'s ``tensor_parallel_size``, an integer >= 1):
    above 1, collectives the platform cannot capture downgrade FULL graphs to PIECEWISE."""
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    first_context_bucket: int = DEFAULT_FIRST_CONTEXT_BUCKET
    """Tokens the smallest context bucket covers; each next one doubles (``runners.batch``)."""
    max_graph_contexts: int = DEFAULT_MAX_GRAPH_CONTEXTS
    """Context buckets graphs are held for; steps in others run eagerly at their exact width."""
    max_num_tokens: int = 64
    """Tokens one step may carry (``--max-num-batched-tokens``: the persistent buffers' size
    and the engine's token budget)."""
    max_model_len: int | None = None
    """Longest request in tokens; ``None``: the checkpoint's ``max_position_embeddings``,
    capped by the KV budget (``runners.capacity``)."""
    max_num_seqs: int = 16
    """Requests in flight at once."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """KV memory budget in bytes; ``None``: ``memory_fraction`` of free device memory."""
    memory_fraction: float | None = None
    """Share of free device memory the KV caches may take (default 0.5)."""
    layout: CacheLayout | None = None
    """An explicit cache layout, instead of the one the capacity options above derive."""
    audit: AuditMode = attrs.field(default="raise", validator=_one_of(AUDIT_MODES))
    load_progress: bool = True
    """Draw a load progress bar on stderr when stderr is a terminal."""
    quantization: str = attrs.field(default="auto", validator=_one_of(LOAD_MODES))
    """How a quantized checkpoint loads: ``auto`` (weight-only), ``weight-only`` or
    ``dequantize`` (``load_checkpoint``); a plain checkpoint and the built-in model ignore it."""
    threads: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Torch CPU threads of this process, set by ``build_engine``; ``None``: the default for the
    model's size (``runners.threads``: one thread up to hidden size 512, torch's own above), as
    ``dsv4 run`` uses without ``--threads``."""
    enable_prefix_caching: bool = attrs.field(default=True, validator=_a_bool)
    """Share the cache blocks of equal prompt prefixes between requests
    (``runners.engine.prefix_cache``); off: every request computes its whole prompt."""


@attrs.frozen(kw_only=True)
class Engine:
    """A built engine: what was resolved, the runner executing it and the ``LLM`` over it."""

    resolution: Resolution
    runner: ModelRunner
    llm: LLM
    capacity: CapacityPlan | None
    """How the cache layout was derived (``None`` for an explicit ``EngineSpec.layout``)."""


def resolve_platform(name: str | Platform | None, *, simulated: bool) -> Platform:
    """The platform ``name`` names or is (the current one for ``None``), simulated if asked."""
    if isinstance(name, Platform):
        platform = name
    else:
        platform = current_platform(simulated=simulated) if name is None else get_platform(name)
    return simulate(platform) if simulated else platform


def compute_dtype_of(spec: EngineSpec) -> torch.dtype:
    """The compute dtype ``spec.dtype`` stands for (``auto``: the checkpoint's ``torch_dtype``)."""
    return resolve_dtype(spec.dtype, spec.checkpoint)


def build_model(spec: EngineSpec) -> DeepseekV4ForCausalLM:
    """Load ``spec.checkpoint``, or build the built-in tiny model with fixed-seed weights, in
    the compute dtype ``spec.dtype`` stands for; at a tensor-parallel size above 1, this rank's
    share of it (``parallel_of``)."""
    dtype = compute_dtype_of(spec)
    parallel = parallel_of(spec)
    if spec.checkpoint is not None:
        return load_checkpoint(
            spec.checkpoint,
            dtype=dtype,
            quantization=spec.quantization,
            progress="terminal" if spec.load_progress else None,
            parallel=parallel,
        )
    config = config_of(spec)
    model = DeepseekV4ForCausalLM(config, dtype=dtype)
    randomize_(model, spec.builtin_seed, num_experts=config.n_routed_experts)
    return model if parallel.size == 1 else shard_model(model, parallel)


def parallel_of(spec: EngineSpec) -> TensorParallel:
    """The tensor-parallel rank this process is for ``spec``: ``SINGLE`` at size 1, else its
    rank of the default process group, which must have ``spec.tensor_parallel_size`` ranks
    (``runners.distributed`` starts them)."""
    size = spec.tensor_parallel_size
    if size == 1:
        return SINGLE
    if not dist.is_initialized() or dist.get_world_size() != size:
        raise ParallelSizeError(
            f"tensor_parallel_size {size} needs a process group of {size} ranks: use "
            "runners.launch_engine, which starts them, or run under torchrun"
        )
    return TensorParallel.from_default_group()


def architecture_of(spec: EngineSpec) -> str:
    """The architecture the checkpoint's config.json names (the built-in model's without one).

    Raises ``UnsupportedArchitectureError`` for an architecture this library does not implement,
    before anything is resolved or loaded; an unreadable config is left for ``load_checkpoint``
    to report.
    """
    return ARCHITECTURE if spec.checkpoint is None else checkpoint_architecture(spec.checkpoint)


def resolve_spec(spec: EngineSpec) -> Resolution:
    """The resolution ``spec`` asks for (raises ``ResolutionError`` for a refused choice)."""
    return resolve(
        architecture_of(spec),
        resolve_platform(spec.platform, simulated=spec.simulate),
        runner=spec.runner,
        cudagraph_mode=spec.cudagraph_mode,
        eager_region=spec.eager_region,
        unsafe_region=spec.unsafe_region,
        tensor_parallel_size=spec.tensor_parallel_size,
    )


def build_engine(spec: EngineSpec, *, model: DeepseekV4ForCausalLM | None = None) -> Engine:
    """Resolve ``spec``, then build the runner and the engine (loading the model if not given).

    Sets this process's torch CPU threads to ``spec.threads`` (``None``: the default for the
    model's size, ``runners.threads``), as ``dsv4 run`` does.

    Capacity options the config alone rules out are refused before the model loads; the KV
    budget's share of free memory is measured after it has loaded."""
    resolution = check_spec(spec, model)
    platform = resolution.platform
    capacity = capacity_of(spec)
    if model is None:
        model = build_model(spec)
    apply_threads(spec.threads, model.config.hidden_size)
    model = model.to(platform.device)
    pack_model(model)
    plan = None
    layout = spec.layout
    if layout is None:
        budget = capacity.budget(platform.device)
        if model.parallel.size > 1:  # every rank plans the same layout: the smallest budget
            # on the device: NCCL serves nothing else (a CPU tensor fails every GPU run)
            smallest = torch.tensor([budget], dtype=torch.int64, device=platform.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=model.parallel.group)
            budget = int(smallest.item())
        plan = capacity.plan(
            model.config, model.compute_dtype, platform.device, spec.max_num_tokens, budget=budget
        )
        layout = plan.layout
        if plan.note is not None:
            warnings.warn(plan.note, MaxModelLenCappedWarning, stacklevel=2)
    runner = build_runner(
        resolution,
        model,
        layout=layout,
        capture_sizes=spec.capture_sizes,
        max_num_tokens=spec.max_num_tokens,
        audit=spec.audit,
        first_context_bucket=spec.first_context_bucket,
        max_graph_contexts=spec.max_graph_contexts,
        collectives_in_graph=resolution.collectives_in_graph,
    )
    return Engine(
        resolution=resolution, runner=runner, llm=llm_of(runner, spec, model.config), capacity=plan
    )


def llm_of(executor: StepExecutor, spec: EngineSpec, config: DeepseekV4Config) -> LLM:
    """The ``LLM`` over ``executor`` for a model of ``config`` from ``spec``'s checkpoint: it
    stops at the checkpoint's EOS ids, decodes with its tokenizer and caches prefixes as
    ``spec`` says."""
    vocab = executor.limits.vocab_size
    tokenizer = tokenizer_of(spec.checkpoint, vocab)
    return LLM(
        executor,
        eos_token_ids=stop_token_ids(config.eos_token_id, spec.checkpoint, vocab_size=vocab),
        detokenize=None if tokenizer is None else tokenizer.decode,
        enable_prefix_caching=spec.enable_prefix_caching,
    )


def check_spec(spec: EngineSpec, model: DeepseekV4ForCausalLM | None = None) -> Resolution:
    """Resolve ``spec`` and refuse, before anything is allocated, what it cannot build: a
    refused choice, a platform not available here, a compute dtype its device cannot compute
    in, a parallel size that does not split the model, capacity options the config rules out
    (for ``model``'s config and dtype when given, else the checkpoint's)."""
    resolution = resolve_spec(spec)
    resolution.platform.require_available()
    dtype = compute_dtype_of(spec) if model is None else model.compute_dtype
    require_dtype(resolution.platform, dtype)
    config = model.config if model is not None else config_of(spec)
    if spec.tensor_parallel_size > 1:
        check_parallel_size(config, spec.tensor_parallel_size)
    if spec.layout is None:
        capacity_of(spec).check(config, dtype)
    return resolution


def capacity_of(spec: EngineSpec) -> Capacity:
    """The capacity options of ``spec`` (``CapacityError`` for a non-positive one)."""
    return Capacity(
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        block_size=spec.block_size,
        kv_cache_memory=spec.kv_cache_memory,
        memory_fraction=spec.memory_fraction,
    )


def config_of(spec: EngineSpec) -> DeepseekV4Config:
    """The model config ``spec`` names, read without loading weights (warnings about its
    fields are left for the load itself, so they are said once)."""
    if spec.checkpoint is None:
        return DeepseekV4Config.tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(spec.checkpoint)


def require_dtype(platform: Platform, dtype: torch.dtype) -> None:
    """Raise ``UnsupportedDtypeError`` unless ``platform``'s device computes in ``dtype``."""
    reason = platform.unsupported_dtype_reason(dtype)
    if reason is not None:
        raise UnsupportedDtypeError(
            f"platform {platform.name} cannot compute in {dtype_name(dtype)}: {reason}; "
            f"choose another compute dtype (--dtype {'|'.join(COMPUTE_DTYPES)})"
        )


def build_runner(
    resolution: Resolution,
    model: DeepseekV4ForCausalLM,
    *,
    layout: CacheLayout,
    capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
    max_num_tokens: int = 256,
    audit: AuditMode = "raise",
    first_context_bucket: int = DEFAULT_FIRST_CONTEXT_BUCKET,
    max_graph_contexts: int = DEFAULT_MAX_GRAPH_CONTEXTS,
    collectives_in_graph: bool = True,
) -> ModelRunner:
    """The runner class ``resolution`` chose, over ``model``, with the resolved graph modes and
    eager region (the model itself is not changed)."""
    return resolution.runner(
        model,
        platform=resolution.platform,
        layout=layout,
        eager_region=resolution.eager_region,
        decode_mode=resolution.decode_mode,
        mixed_mode=resolution.mixed_mode,
        capture_sizes=capture_sizes,
        max_num_tokens=max_num_tokens,
        audit=audit,
        first_context_bucket=first_context_bucket,
        max_graph_contexts=max_graph_contexts,
        collectives_in_graph=collectives_in_graph,
    )
