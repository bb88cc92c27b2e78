"""Operators of this project backed by the native CPU kernels (``dsv4/_kernels.c``).

Each is an ``_into`` operator (``torch.library``): it writes tensors its caller allocated
(``empty``, which a graph does not replay) and returns nothing, so a capture records one op and
replays it as recorded. They have CPU kernels only: callers take them where ``native_takes`` holds
for every tensor they hand over — the kernels were built, the tensors are float32 CPU tensors
laid out as the kernel reads them, and no autograd is recording — and ATen's ops elsewhere. How
each kernel rounds against those ATen ops is stated in ``dsv4/_kernels.c`` and drawn in
``tests/dsv4/test_native_*.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dsv4.native import KERNELS, prebound
from graphs.bound_kernels import Binder, BoundCall, register_binder
from graphs.tape.stale import register_row_writes

__all__ = [
    "ATTEND_INTO",
    "COS_SIN_INTO",
    "GATHER_ROWS_INTO",
    "GROUPED_LINEAR_INTO",
    "HC_COLLAPSE_INTO",
    "HC_MIX_INTO",
    "HC_PRE_INTO",
    "HC_WEIGHTS_INTO",
    "INDEX_SCORES_INTO",
    "LINEAR_INTO",
    "LINEAR_PANELS_INTO",
    "POOL_INTO",
    "RMS_NORM_INTO",
    "ROPE_INTO",
    "ROUTED_EXPERTS_INTO",
    "ROUTE_INTO",
    "SCATTER_ROWS_",
    "SIGMOID_INTO",
    "STABLE_TOPK_INTO",
    "SWIGLU_INTO",
    "SWIGLU_MLP_INTO",
    "bound_call",
    "native_takes",
    "row_stride",
    "rows_take",
]

_LIBRARY = torch.library.Library("dsv4", "FRAGMENT")
_LIBRARY.define("rms_norm_into(Tensor(a!) out, Tensor x, Tensor? weight, float eps) -> ()")
_LIBRARY.define(
    "hc_weights_into(Tensor(a!) pre, Tensor(b!) post, Tensor(c!) bordered, Tensor logits, "
    "Tensor scale, Tensor base, float eps, int iters) -> ()"
)
_LIBRARY.define("hc_collapse_into(Tensor(a!) out, Tensor pre, Tensor x) -> ()")
_LIBRARY.define(
    "hc_mix_into(Tensor(a!) out, Tensor streams, Tensor post, Tensor comb_t, Tensor output) -> ()"
)
_LIBRARY.define("linear_into(Tensor(a!) out, Tensor x, Tensor weight) -> ()")
_LIBRARY.define("grouped_linear_into(Tensor(a!) out, Tensor x, Tensor weight) -> ()")
_LIBRARY.define("linear_panels_into(Tensor(a!) out, Tensor x, Tensor panels) -> ()")
_LIBRARY.define(
    "routed_experts_into(Tensor(a!) out, Tensor x, Tensor experts, Tensor weights, "
    "Tensor gate_up, Tensor down, float limit) -> ()"
)
_LIBRARY.define(
    "attend_into(Tensor(a!) out, Tensor queries, Tensor keys, Tensor key_rows, Tensor key_seen, "
    "Tensor? entries, Tensor? entry_rows, Tensor? entry_seen, Tensor sinks, float scaling, "
    "ScalarType? rounding=None) -> ()"
)
_LIBRARY.define(
    "route_into(Tensor(a!) experts, Tensor(b!) weights, Tensor(c!) scores, Tensor(d!) biased, "
    "Tensor logits, Tensor? bias, float scaling, bool sigmoid) -> ()"
)
_LIBRARY.define(
    "index_scores_into(Tensor(a!) out, Tensor queries, Tensor keys, Tensor weights, "
    "Tensor visible, float scale) -> ()"
)
_LIBRARY.define(
    "pool_into(Tensor(a!) out, Tensor kv, Tensor gate, Tensor rows, Tensor? masked, "
    "ScalarType? rounding=None) -> ()"
)
_LIBRARY.define(
    "hc_pre_into(Tensor(a!) pre, Tensor(b!) post, Tensor(c!) bordered, Tensor(d!) collapsed, "
    "Tensor(e!) flat, Tensor(f!) logits, Tensor x, Tensor fn_panels, Tensor scale, Tensor base, "
    "float norm_eps, float eps, int iters) -> ()"
)
_LIBRARY.define(
    "swiglu_mlp_into(Tensor(a!) out, Tensor(b!) gated, Tensor(c!) upped, Tensor(d!) activated, "
    "Tensor x, Tensor gate_panels, Tensor up_panels, Tensor down_panels, float limit) -> ()"
)
_LIBRARY.define("gather_rows_into(Tensor(a!) out, Tensor table, Tensor rows) -> ()")
_LIBRARY.define("scatter_rows_(Tensor(a!) table, Tensor rows, Tensor values) -> ()")
_LIBRARY.define("stable_topk_into(Tensor(a!) out, Tensor scores) -> ()")
_LIBRARY.define("swiglu_into(Tensor(a!) out, Tensor gate, Tensor up, float limit) -> ()")
_LIBRARY.define("sigmoid_into(Tensor(a!) out, Tensor x) -> ()")
_LIBRARY.define("cos_sin_into(Tensor(a!) cos, Tensor(b!) sin, Tensor angles) -> ()")
_LIBRARY.define(
    "rope_into(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin, Tensor swap, bool inverse) -> ()"
)


def native_takes(*tensors: torch.Tensor | None, strided: torch.Tensor | None = None) -> bool:
    """Whether the native operators may run on ``tensors`` (each ``None``, or a contiguous
    float32 CPU tensor) and ``strided`` (float32 CPU, any strides): the kernels were built and
    autograd is not recording."""
    if KERNELS is None or torch.is_grad_enabled():
        return False
    contiguous = all(
        t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
        for t in tensors
    )
    return contiguous and (
        strided is None or (strided.dtype == torch.float32 and strided.device.type == "cpu")
    )


def rows_take(table: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether a row copy of ``table`` (any dtype, contiguous, on the CPU, at least one axis) at
    ``rows`` (contiguous int64) is one native op (``gather_rows_into``, ``scatter_rows_``): the
    kernels were built and autograd is not recording. Bytes are copied, so it equals ATen's."""
    return (
        KERNELS is not None
        and not torch.is_grad_enabled()
        and table.device.type == "cpu"
        and table.dim() > 0
        and table.is_contiguous()
        and rows.dtype == torch.int64
        and rows.device.type == "cpu"
        and rows.is_contiguous()
    )


def row_stride(t: torch.Tensor, rows: int) -> int | None:
    """The distance between consecutive rows of a float32 CPU ``t`` seen as ``rows`` rows of its
    last axis (contiguous), its leading axes collapsed; ``None`` where they do not collapse to
    evenly spaced rows that do not overlap."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() == 0 or t.stride(-1) != 1:
        return None
    sizes, strides = t.shape[:-1], t.stride()[:-1]
    leading = [(size, stride) for size, stride in zip(sizes, strides, strict=True) if size != 1]
    if not leading:
        return t.shape[-1] if rows == 1 else None
    step = expected = leading[-1][1]
    for size, stride in reversed(leading):
        if stride != expected:
            return None
        expected = stride * size
    return step if step >= t.shape[-1] and expected == step * rows else None


def bound_call(kernel: Any, tensors: tuple[torch.Tensor | None, ...], *arguments: Any) -> BoundCall:
    """``kernel(*arguments)`` as a zero-argument call holding ``tensors`` (whose addresses are
    among ``arguments``), so their memory lives as long as the call."""
    call = prebound(kernel, *arguments)
    call.tensors = tensors  # type: ignore[attr-defined]
    return call


def _require(holds: bool, operator: str, what: str) -> None:
    """Refuse a call whose tensors the kernel would read out of bounds (it trusts the sizes)."""
    if not holds:
        raise ValueError(f"dsv4::{operator}: {what}")


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bind_rms_norm(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> BoundCall:
    assert KERNELS is not None
    width = x.shape[-1]
    _require(
        out.shape == x.shape and (weight is None or weight.shape == (width,)),
        "rms_norm_into",
        "out like x [..., D], weight [D]",
    )
    return bound_call(
        KERNELS.dsv4_rms_norm_f32,
        (out, x, weight),
        out.data_ptr(),
        x.data_ptr(),
        _address(weight),
        x.numel() // width,
        width,
        eps,
    )


def _bind_hc_weights(
    pre: torch.Tensor,
    post: torch.Tensor,
    bordered: torch.Tensor,
    logits: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    eps: float,
    iters: int,
) -> BoundCall:
    assert KERNELS is not None
    tensors = (pre, post, bordered, logits, scale, base)
    tokens, n = pre.shape
    addresses = [t.data_ptr() for t in tensors]
    return bound_call(KERNELS.dsv4_hc_weights_f32, tensors, *addresses, tokens, n, eps, iters)


def _bind_hc_collapse(out: torch.Tensor, pre: torch.Tensor, x: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    tokens, n, hidden = x.shape
    addresses = [t.data_ptr() for t in (out, pre, x)]
    return bound_call(KERNELS.dsv4_hc_collapse_f32, (out, pre, x), *addresses, tokens, n, hidden)


def _bind_hc_mix(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb_t: torch.Tensor,
    output: torch.Tensor,
) -> BoundCall:
    assert KERNELS is not None
    tokens, n, hidden = streams.shape
    return bound_call(
        KERNELS.dsv4_hc_mix_f32,
        (out, streams, post, comb_t, output),
        *(t.data_ptr() for t in (out, streams, post, comb_t)),
        *comb_t.stride(),
        output.data_ptr(),
        tokens,
        n,
        hidden,
    )


def _bind_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    out_features, in_features = weight.shape
    _require(
        x.dim() > 0 and x.shape[-1] == in_features and out.shape == (*x.shape[:-1], out_features),
        "linear_into",
        "x [..., in], weight [out, in], out [..., out]",
    )
    return bound_call(
        KERNELS.dsv4_linear_f32,
        (out, x, weight),
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.numel() // in_features,
        out_features,
        in_features,
    )


def _bind_grouped_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    groups, out_features, in_features = weight.shape
    _require(
        x.shape[-2:] == (groups, in_features) and out.shape == (*x.shape[:-1], out_features),
        "grouped_linear_into",
        "x [..., G, in], weight [G, out, in], out [..., G, out]",
    )
    return bound_call(
        KERNELS.dsv4_grouped_linear_f32,
        (out, x, weight),
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.numel() // (groups * in_features),
        groups,
        out_features,
        in_features,
    )


def _bind_swiglu(
    out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float
) -> BoundCall:
    assert KERNELS is not None
    width = out.shape[-1]
    rows = out.numel() // width
    gate_stride, up_stride = row_stride(gate, rows), row_stride(up, rows)
    assert gate_stride is not None and up_stride is not None
    return bound_call(
        KERNELS.dsv4_swiglu_f32,
        (out, gate, up),
        out.data_ptr(),
        gate.data_ptr(),
        gate_stride,
        up.data_ptr(),
        up_stride,
        rows,
        width,
        limit,
    )


def _bind_sigmoid(out: torch.Tensor, x: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    _require(out.shape == x.shape, "sigmoid_into", "out of x's shape")
    return bound_call(KERNELS.dsv4_sigmoid_f32, (out, x), out.data_ptr(), x.data_ptr(), x.numel())


def _bind_cos_sin(cos: torch.Tensor, sin: torch.Tensor, angles: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    _require(
        cos.shape == angles.shape and sin.shape == angles.shape,
        "cos_sin_into",
        "cos and sin of the angles' shape",
    )
    return bound_call(
        KERNELS.dsv4_cos_sin_f32,
        (cos, sin, angles),
        cos.data_ptr(),
        sin.data_ptr(),
        angles.data_ptr(),
        angles.numel(),
    )


def _bind_rope(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    swap: torch.Tensor,
    inverse: bool,
) -> BoundCall:
    assert KERNELS is not None
    tokens, width = x.shape[0], x.shape[-1]
    return bound_call(
        KERNELS.dsv4_rope_f32,
        (out, x, cos, sin, swap),
        *(t.data_ptr() for t in (out, x, cos, sin)),
        cos.stride(0),
        swap.data_ptr(),
        tokens,
        x.numel() // (tokens * width),
        width,
        int(inverse),
    )


def _bind_linear_panels(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    _require(panels.dim() == 4, "linear_panels_into", "panels [G, out / P, in, P]")
    groups, count, depth, panel = panels.shape
    rows = x.numel() // (groups * depth) if groups * depth else 0
    _require(
        x.numel() == rows * groups * depth and out.numel() == rows * groups * count * panel,
        "linear_panels_into",
        "x [..., G * in] and out [..., G * out] for panels [G, out / P, in, P]",
    )
    return bound_call(
        KERNELS.dsv4_linear_panels_f32,
        (out, x, panels),
        out.data_ptr(),
        x.data_ptr(),
        panels.data_ptr(),
        rows,
        groups,
        depth,
        panel,
        count,
    )


def _bind_routed_experts(
    out: torch.Tensor,
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> BoundCall:
    assert KERNELS is not None
    what = (
        "x and out [T, hidden], weights like experts [T, k], stacks in panels [E, 2I / P, "
        "hidden, P] and [E, hidden / P', I, P']"
    )
    _require(experts.dim() == 2 and gate_up.dim() == down.dim() == 4, "routed_experts_into", what)
    tokens, k = experts.shape
    num_experts, gate_up_panels, hidden, gate_up_panel = gate_up.shape
    double_inter = gate_up_panels * gate_up_panel
    _require(
        x.shape == out.shape == (tokens, hidden)
        and weights.shape == experts.shape
        and double_inter % 2 == 0
        and down.shape[0] == num_experts
        and down.shape[2] == double_inter // 2
        and down.shape[1] * down.shape[3] == hidden,
        "routed_experts_into",
        what,
    )
    tensors = (out, x, experts, weights, gate_up, down)
    return bound_call(
        KERNELS.dsv4_routed_experts_f32,
        tensors,
        *(t.data_ptr() for t in tensors),
        tokens,
        k,
        num_experts,
        hidden,
        double_inter // 2,
        gate_up_panel,
        down.shape[3],
        limit,
    )


_ROUNDING_CODES: dict[torch.dtype | None, int] = {
    None: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}
"""The kernels' ``rounding`` codes (``dsv4/_kernels.c``'s ``round_to``): the narrow dtype an
operator on float32 copies rounds its intermediate values to where the composite it replaces
computes in that dtype, or none."""


def _rounding_code(rounding: torch.dtype | None, name: str) -> int:
    _require(rounding in _ROUNDING_CODES, name, "rounding None, torch.bfloat16 or torch.float16")
    return _ROUNDING_CODES[rounding]


def _bind_attend(
    out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_rows: torch.Tensor,
    key_seen: torch.Tensor,
    entries: torch.Tensor | None,
    entry_rows: torch.Tensor | None,
    entry_seen: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float,
    rounding: torch.dtype | None = None,
) -> BoundCall:
    assert KERNELS is not None
    tokens, heads, width = queries.shape
    with_entries = entries is not None and entry_rows is not None and entry_seen is not None
    per_entries = entry_rows.shape[1] if with_entries and entry_rows is not None else 0
    _require(
        out.shape == queries.shape
        and keys.dim() == 2
        and keys.shape[1] == width
        and key_rows.dim() == 2
        and key_rows.shape[0] == tokens
        and key_seen.shape == key_rows.shape
        and sinks.shape == (heads,)
        and (entries is None) == (entry_rows is None) == (entry_seen is None)
        and (
            not with_entries
            or (
                entries is not None
                and entry_rows is not None
                and entry_seen is not None
                and entries.dim() == 2
                and entries.shape[1] == width
                and entry_rows.shape == entry_seen.shape == (tokens, per_entries)
            )
        ),
        "attend_into",
        "out like queries [T, H, D], key tables [N, D], rows and seen [T, W] and [T, E], sinks [H]",
    )
    tensors = (out, queries, keys, key_rows, key_seen, entries, entry_rows, entry_seen, sinks)
    return bound_call(
        KERNELS.dsv4_attend_f32,
        tensors,
        *(_address(t) for t in tensors),
        tokens,
        heads,
        width,
        keys.shape[0],
        key_rows.shape[1],
        entries.shape[0] if entries is not None else 0,
        per_entries,
        scaling,
        _rounding_code(rounding, "attend_into"),
    )


def _bind_stable_topk(out: torch.Tensor, scores: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    width, k = scores.shape[-1], out.shape[-1]
    _require(
        out.shape[:-1] == scores.shape[:-1] and 0 <= k <= width,
        "stable_topk_into",
        "out [..., k] for scores [..., n], k at most n",
    )
    return bound_call(
        KERNELS.dsv4_stable_topk_f32,
        (out, scores),
        out.data_ptr(),
        scores.data_ptr(),
        scores.numel() // width,
        width,
        k,
    )


def _bind_route(
    experts: torch.Tensor,
    weights: torch.Tensor,
    scores: torch.Tensor,
    biased: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
    sigmoid: bool,
) -> BoundCall:
    assert KERNELS is not None
    tokens, width = logits.shape
    k = experts.shape[-1]
    _require(
        experts.shape == weights.shape == (tokens, k)
        and 0 < k <= width
        and scores.shape == biased.shape == logits.shape
        and (bias is None or bias.shape == (width,)),
        "route_into",
        "logits, scores and biased [T, E], experts and weights [T, k], bias [E]",
    )
    tensors = (experts, weights, scores, biased, logits, bias)
    return bound_call(
        KERNELS.dsv4_route_f32,
        tensors,
        *(_address(t) for t in tensors),
        tokens,
        width,
        k,
        int(sigmoid),
        scaling,
    )


def _bind_index_scores(
    out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> BoundCall:
    assert KERNELS is not None
    tokens, heads, width = queries.shape
    _require(
        keys.dim() == 3
        and keys.shape[0] == tokens
        and keys.shape[2] == width
        and weights.shape == (tokens, heads)
        and out.shape == visible.shape == keys.shape[:2],
        "index_scores_into",
        "queries [T, H, D], keys [T, S, D], weights [T, H], out and visible [T, S]",
    )
    tensors = (out, queries, keys, weights, visible)
    return bound_call(
        KERNELS.dsv4_index_scores_f32,
        tensors,
        *(t.data_ptr() for t in tensors),
        tokens,
        heads,
        keys.shape[1],
        width,
        scale,
    )


def _bind_pool(
    out: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    rows: torch.Tensor,
    masked: torch.Tensor | None,
    rounding: torch.dtype | None = None,
) -> BoundCall:
    assert KERNELS is not None
    tokens, span = rows.shape
    count, width = kv.shape
    _require(
        gate.shape == kv.shape
        and out.shape == (tokens, width)
        and (masked is None or masked.numel() == tokens * span),
        "pool_into",
        "kv and gate [N, D], rows [T, S], masked [T, S], out [T, D]",
    )
    tensors = (out, kv, gate, rows, masked)
    return bound_call(
        KERNELS.dsv4_pool_f32,
        tensors,
        *(_address(t) for t in tensors),
        tokens,
        span,
        count,
        width,
        _rounding_code(rounding, "pool_into"),
    )


def _one_matrix_in_panels(panels: torch.Tensor, depth: int, width: int) -> int | None:
    """The panel width of ``panels`` where it holds one ``depth`` x ``width`` matrix in panels
    (``[1, width / panel, depth, panel]``, ``dsv4.panels.in_panels``), else ``None``."""
    if panels.dim() != 4 or panels.shape[0] != 1 or panels.shape[2] != depth:
        return None
    panel = panels.shape[3]
    return panel if panel > 0 and panels.shape[1] * panel == width else None


def _bind_hc_pre(
    pre: torch.Tensor,
    post: torch.Tensor,
    bordered: torch.Tensor,
    collapsed: torch.Tensor,
    flat: torch.Tensor,
    logits: torch.Tensor,
    x: torch.Tensor,
    fn_panels: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    eps: float,
    iters: int,
) -> BoundCall:
    assert KERNELS is not None
    tokens, n, hidden = x.shape
    mixing = (2 + n) * n
    panel = _one_matrix_in_panels(fn_panels, n * hidden, mixing)
    _require(
        panel is not None
        and pre.shape == post.shape == (tokens, n)
        and bordered.shape == (tokens, n + 1, n + 1)
        and collapsed.shape == (tokens, hidden)
        and flat.shape == (tokens, n * hidden)
        and logits.shape == (tokens, mixing)
        and scale.shape == (3,)
        and base.shape == (mixing,),
        "hc_pre_into",
        "x [T, n, D], fn_panels [1, (2 + n) n / P, n D, P], scale [3], base [(2 + n) n] and "
        "outputs to match",
    )
    assert panel is not None
    tensors = (pre, post, bordered, collapsed, flat, logits, x, fn_panels, scale, base)
    return bound_call(
        KERNELS.dsv4_hc_pre_f32,
        tensors,
        *(t.data_ptr() for t in tensors),
        tokens,
        n,
        hidden,
        panel,
        mixing // panel,
        norm_eps,
        eps,
        iters,
    )


def _bind_swiglu_mlp(
    out: torch.Tensor,
    gated: torch.Tensor,
    upped: torch.Tensor,
    activated: torch.Tensor,
    x: torch.Tensor,
    gate_panels: torch.Tensor,
    up_panels: torch.Tensor,
    down_panels: torch.Tensor,
    limit: float,
) -> BoundCall:
    assert KERNELS is not None
    tokens, hidden = x.shape
    inter = gated.shape[-1]
    inter_panel = _one_matrix_in_panels(gate_panels, hidden, inter)
    hidden_panel = _one_matrix_in_panels(down_panels, inter, hidden)
    _require(
        inter_panel is not None
        and hidden_panel is not None
        and up_panels.shape == gate_panels.shape
        and out.shape == x.shape
        and gated.shape == upped.shape == activated.shape == (tokens, inter),
        "swiglu_mlp_into",
        "x [T, D], gate_panels and up_panels [1, I / P, D, P], down_panels [1, D / Q, I, Q] "
        "and outputs to match",
    )
    tensors = (out, gated, upped, activated, x, gate_panels, up_panels, down_panels)
    return bound_call(
        KERNELS.dsv4_swiglu_mlp_f32,
        tensors,
        *(t.data_ptr() for t in tensors),
        tokens,
        hidden,
        inter,
        inter_panel,
        hidden_panel,
        limit,
    )


def _bind_gather_rows(out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    _require(
        out.shape == (*rows.shape, *table.shape[1:])
        and out.dtype == table.dtype
        and out.is_contiguous(),
        "gather_rows_into",
        "out [*rows, *row] of the table's dtype, contiguous",
    )
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    return bound_call(
        KERNELS.dsv4_gather_rows,
        (out, table, rows),
        out.data_ptr(),
        table.data_ptr(),
        rows.data_ptr(),
        rows.numel(),
        table.shape[0],
        row_bytes,
    )


def _bind_scatter_rows(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> BoundCall:
    assert KERNELS is not None
    _require(
        values.shape == (*rows.shape, *table.shape[1:])
        and values.dtype == table.dtype
        and values.is_contiguous(),
        "scatter_rows_",
        "values [*rows, *row] of the table's dtype, contiguous",
    )
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    return bound_call(
        KERNELS.dsv4_scatter_rows,
        (table, rows, values),
        table.data_ptr(),
        rows.data_ptr(),
        values.data_ptr(),
        rows.numel(),
        table.shape[0],
        row_bytes,
    )


_FAILURES: dict[int, tuple[type[Exception], str]] = {
    -1: (MemoryError, "out of memory for its scratch rows"),
    -2: (IndexError, "index out of range: an index outside its table"),
}
"""What a kernel's negative status means (``dsv4/_kernels.c``), raised as ATen raises it."""


def _run_bound(name: str, bind: Binder) -> Callable[..., None]:
    """The CPU kernel of operator ``name`` whose binder is ``bind``: bind, then call; a kernel's
    failure status raises here (a replay, like a CUDA graph's launch, does not look)."""

    def kernel(*args: Any) -> None:
        status = bind(*args)()
        if isinstance(status, int) and status != 0:
            error, what = _FAILURES.get(status, (RuntimeError, f"status {status}"))
            raise error(f"dsv4::{name} failed: {what}")

    return kernel


_BINDERS: dict[str, Binder] = {
    "rms_norm_into": _bind_rms_norm,
    "hc_weights_into": _bind_hc_weights,
    "hc_collapse_into": _bind_hc_collapse,
    "hc_mix_into": _bind_hc_mix,
    "linear_into": _bind_linear,
    "grouped_linear_into": _bind_grouped_linear,
    "linear_panels_into": _bind_linear_panels,
    "swiglu_into": _bind_swiglu,
    "rope_into": _bind_rope,
    "sigmoid_into": _bind_sigmoid,
    "cos_sin_into": _bind_cos_sin,
    "routed_experts_into": _bind_routed_experts,
    "attend_into": _bind_attend,
    "stable_topk_into": _bind_stable_topk,
    "route_into": _bind_route,
    "index_scores_into": _bind_index_scores,
    "pool_into": _bind_pool,
    "hc_pre_into": _bind_hc_pre,
    "swiglu_mlp_into": _bind_swiglu_mlp,
    "gather_rows_into": _bind_gather_rows,
    "scatter_rows_": _bind_scatter_rows,
}
for _name, _bind in _BINDERS.items():
    _LIBRARY.impl(_name, _run_bound(_name, _bind), "CPU")
    register_binder(getattr(torch.ops.dsv4, _name).default, _bind)

ATTEND_INTO = torch.ops.dsv4.attend_into.default
RMS_NORM_INTO = torch.ops.dsv4.rms_norm_into.default
HC_WEIGHTS_INTO = torch.ops.dsv4.hc_weights_into.default
HC_COLLAPSE_INTO = torch.ops.dsv4.hc_collapse_into.default
HC_PRE_INTO = torch.ops.dsv4.hc_pre_into.default
INDEX_SCORES_INTO = torch.ops.dsv4.index_scores_into.default
HC_MIX_INTO = torch.ops.dsv4.hc_mix_into.default
STABLE_TOPK_INTO = torch.ops.dsv4.stable_topk_into.default
SWIGLU_INTO = torch.ops.dsv4.swiglu_into.default
SWIGLU_MLP_INTO = torch.ops.dsv4.swiglu_mlp_into.default
LINEAR_INTO = torch.ops.dsv4.linear_into.default
LINEAR_PANELS_INTO = torch.ops.dsv4.linear_panels_into.default
POOL_INTO = torch.ops.dsv4.pool_into.default
GROUPED_LINEAR_INTO = torch.ops.dsv4.grouped_linear_into.default
GATHER_ROWS_INTO = torch.ops.dsv4.gather_rows_into.default
SCATTER_ROWS_ = torch.ops.dsv4.scatter_rows_.default
register_row_writes(SCATTER_ROWS_, lambda table, rows, values: (0, rows))
ROPE_INTO = torch.ops.dsv4.rope_into.default
SIGMOID_INTO = torch.ops.dsv4.sigmoid_into.default
COS_SIN_INTO = torch.ops.dsv4.cos_sin_into.default
ROUTED_EXPERTS_INTO = torch.ops.dsv4.routed_experts_into.default
ROUTE_INTO = torch.ops.dsv4.route_into.default
