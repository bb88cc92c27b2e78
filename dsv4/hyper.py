"""Manifold-constrained hyper-connections: a residual stream of ``hc_mult`` copies.

Each block reads one collapsed input (``pre``-weighted sum of the streams) and writes back
``post * block_output + comb^T @ streams``. ``pre``/``post``/``comb`` come from one linear map of
the RMS-normalised, flattened streams; ``comb`` is pushed towards a doubly-stochastic matrix by
``hc_sinkhorn_iters`` rounds of Sinkhorn normalisation (columns first). Everything that
computes the mixing weights runs in fp32 with fp32 parameters, as in the reference.

Op economy (a step costs per op, eagerly and on the CPU tape): the three scale/bias pairs are
applied to all ``(2 + n) * n`` mixing logits at once, which one ``split`` then cuts into the
three parts; the Sinkhorn rounds are one operator (``sinkhorn_``, so a capture records one op
for them), on the CPU one native kernel (``dsv4/_kernels.c``, bit-equal to the composite),
elsewhere a composite whose every half-step is two kernels, a batched product and an in-place
division (``x /= ones @ bordered``): ``comb`` lives in the top-left block of
``bordered [T, n+1, n+1]`` (one ``full`` of ``eps`` plus the softmax added in place), whose
last row and column hold ``eps``, so one product over ``n + 1`` entries gives the column (or,
through the transpose, row) sums with ``eps`` added last, as the reference adds it. Products
and sums keep the reference's rounding steps (no fused multiply-adds), so bf16 models still
round where the reference rounds.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dsv4.layers import as_dtype, linear, panel_product, panels_for, rms_norm
from dsv4.native import KERNELS
from dsv4.native_ops import (
    HC_COLLAPSE_INTO,
    HC_MIX_INTO,
    HC_PRE_INTO,
    HC_WEIGHTS_INTO,
    SIGMOID_INTO,
    bound_call,
    native_takes,
)
from dsv4.panels import PanelCopy
from graphs.bound_kernels import BoundCall, register_binder

__all__ = ["HyperConnection", "HyperHead", "mix", "sinkhorn_"]


_LIBRARY = torch.library.Library("dsv4", "FRAGMENT")
_LIBRARY.define("sinkhorn_(Tensor(a!) bordered, Tensor ones, int iters) -> ()")


def _sinkhorn_rounds(
    bordered: torch.Tensor, ones: torch.Tensor, iters: int, *, differentiable: bool = False
) -> None:
    """The rounds as kernels: the sums into one buffer (``bmm(out=)``), or, ``differentiable``,
    each sum a fresh tensor (autograd takes no ``out=``); the same kernels and values."""
    tokens, n = bordered.shape[0], bordered.shape[-1] - 1
    comb = bordered[:, :n, :n]
    comb_t = comb.transpose(1, 2)
    columns, rows = bordered[:, :, :n], bordered.transpose(1, 2)[:, :, :n]
    ones = ones.expand(tokens, 1, n + 1)
    sums = None if differentiable else bordered.new_empty(tokens, 1, n)
    comb.div_(torch.bmm(ones, columns, out=sums))
    for _ in range(iters - 1):
        comb_t.div_(torch.bmm(ones, rows, out=sums))
        comb.div_(torch.bmm(ones, columns, out=sums))


def _bind_sinkhorn(bordered: torch.Tensor, ones: torch.Tensor, iters: int) -> BoundCall:
    """The CPU kernel, bound (``graphs.bound_kernels``): one native call for a contiguous
    float32 ``bordered`` (every model's, as the mixing weights are fp32), bit-equal to the rounds
    as kernels, which run for anything else or where the native kernels were not built."""
    if KERNELS is not None and bordered.dtype == torch.float32 and bordered.is_contiguous():
        n = bordered.shape[-1] - 1
        kernel = KERNELS.dsv4_sinkhorn_f32
        return bound_call(kernel, (bordered,), bordered.data_ptr(), bordered.shape[0], n, iters)
    return functools.partial(_sinkhorn_rounds, bordered, ones, iters)


def _sinkhorn_cpu(bordered: torch.Tensor, ones: torch.Tensor, iters: int) -> None:
    _bind_sinkhorn(bordered, ones, iters)()


_LIBRARY.impl("sinkhorn_", _sinkhorn_rounds, "CompositeExplicitAutograd")
_LIBRARY.impl("sinkhorn_", _sinkhorn_cpu, "CPU")
register_binder(torch.ops.dsv4.sinkhorn_.default, _bind_sinkhorn)
_SINKHORN = torch.ops.dsv4.sinkhorn_.default


def sinkhorn_(bordered: torch.Tensor, ones: torch.Tensor, iters: int) -> None:
    """``iters`` Sinkhorn rounds (columns first) on the ``[T, n, n]`` top-left block of
    ``bordered [T, n+1, n+1]`` (its last row and column ``eps``), in place; ``ones``
    ``[1, 1, n+1]``. ``ones @ (the block over its eps row)`` is the column sums plus ``eps``;
    through the transpose, the row sums.

    One operator (``dsv4::sinkhorn_``, registered with ``torch.library.Library``, whose calls
    cost about 4 us, where ``torch.library.custom_op`` imports ``torch._dynamo`` on the first
    call, a second or more): a graph records it as one op. On the CPU it is one native call
    (``_sinkhorn_cpu``); elsewhere its ``2 * (2 * iters - 1)`` kernels run as they would
    unwrapped, into one buffer of sums. Where autograd records
    (``bordered`` requires grad, grad enabled: a forward outside inference mode) the same
    kernels run unwrapped, each sum a fresh tensor, so the rounds stay differentiable."""
    if torch.is_grad_enabled() and bordered.requires_grad:
        _sinkhorn_rounds(bordered, ones, iters, differentiable=True)
        return
    _SINKHORN(bordered, ones, iters)


class HyperConnection(nn.Module):
    """Mixing weights around one block (reference names ``fn``, ``base``, ``scale``)."""

    scale_index: torch.Tensor
    ones: torch.Tensor

    def __init__(
        self, hc_mult: int, hidden_size: int, *, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))
        self.fn_panels: torch.Tensor | None
        self._copy = PanelCopy(self, "fn_panels")
        # which of the three scales each mixing logit takes: pre (n), post (n), comb (n * n)
        index = torch.tensor([0] * hc_mult + [1] * hc_mult + [2] * hc_mult * hc_mult)
        self.register_buffer("scale_index", index, persistent=False)
        self.register_buffer("ones", torch.ones(1, 1, hc_mult + 1), persistent=False)

    def pack_panels(self) -> int:
        """Keep a copy of ``fn`` in panels (``dsv4.panels.PanelCopy``); returns its bytes."""
        return self._copy.pack_matrix(self, self.fn)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, n, hidden]`` -> ``post [T, n]``, ``comb^T [T, n, n]``, block input."""
        n, tokens, eps = self.hc_mult, streams.shape[0], self.eps
        x = as_dtype(streams, torch.float32)
        width = x.shape[1] * x.shape[2]
        fn_panels = panels_for(self, self._copy, self.fn, x, width)
        if fn_panels is not None and native_takes(self.scale, self.base):
            # norm, product (on the copy in panels), weights and collapse in one native op
            pre, post = x.new_empty(tokens, n), x.new_empty(tokens, n)
            bordered = x.new_empty(tokens, n + 1, n + 1)
            collapsed, flat = x.new_empty(tokens, x.shape[-1]), x.new_empty(tokens, width)
            logits = x.new_empty(tokens, self.fn.shape[0])
            HC_PRE_INTO(
                pre,
                post,
                bordered,
                collapsed,
                flat,
                logits,
                x,
                fn_panels,
                self.scale,
                self.base,
                self.norm_eps,
                eps,
                self.sinkhorn_iters,
            )
            return post, bordered[:, :n, :n].transpose(1, 2), as_dtype(collapsed, streams.dtype)
        flat = rms_norm(x.flatten(1), None, self.norm_eps)
        if native_takes(x, self.scale, self.base):  # the weights, then the collapse: two ops
            logits = panel_product(self, self._copy, flat, self.fn)
            pre, post = x.new_empty(tokens, n), x.new_empty(tokens, n)
            bordered = x.new_empty(tokens, n + 1, n + 1)
            HC_WEIGHTS_INTO(
                pre, post, bordered, logits, self.scale, self.base, eps, self.sinkhorn_iters
            )
            collapsed = x.new_empty(tokens, x.shape[-1])
            HC_COLLAPSE_INTO(collapsed, pre, x)
            return post, bordered[:, :n, :n].transpose(1, 2), as_dtype(collapsed, streams.dtype)
        scale = self.scale.index_select(0, self.scale_index)
        logits = linear(flat, self.fn) * scale + self.base
        pre, post, comb_logits = logits.split((n, n, n * n), dim=1)
        pre = torch.sigmoid(pre) + eps
        post = torch.sigmoid(post) * 2
        bordered = torch.full((tokens, n + 1, n + 1), eps, dtype=x.dtype, device=x.device)
        comb = bordered[:, :n, :n]
        comb.add_(torch.softmax(comb_logits.view(tokens, n, n), dim=-1))  # eps + p == p + eps
        sinkhorn_(bordered, self.ones, self.sinkhorn_iters)
        collapsed = as_dtype(torch.einsum("tn,tnh->th", pre, x), streams.dtype)
        return post, comb.transpose(1, 2), collapsed


def mix(
    streams: torch.Tensor, post: torch.Tensor, comb_t: torch.Tensor, output: torch.Tensor
) -> torch.Tensor:
    """New streams: ``post * output`` spread over the copies plus ``comb^T @ streams``."""
    if native_takes(streams, post, output, strided=comb_t):
        out = torch.empty_like(streams)
        HC_MIX_INTO(out, streams, post, comb_t, output)
        return out
    dtype = streams.dtype
    carried = torch.bmm(as_dtype(comb_t, dtype), streams)
    return as_dtype(post, dtype).unsqueeze(-1) * output.unsqueeze(-2) + carried


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm (``hc_fn``/``hc_base``/``hc_scale``)."""

    def __init__(self, hc_mult: int, hidden_size: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.hc_fn_panels: torch.Tensor | None
        self._copy = PanelCopy(self, "hc_fn_panels")

    def pack_panels(self) -> int:
        """Keep a copy of ``hc_fn`` in panels (``dsv4.panels.PanelCopy``); returns its bytes."""
        return self._copy.pack_matrix(self, self.hc_fn)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        x = as_dtype(streams, torch.float32)
        flat = rms_norm(x.flatten(1), None, self.norm_eps)
        logits = panel_product(self, self._copy, flat, self.hc_fn) * self.hc_scale + self.hc_base
        pre = _sigmoid(logits) + self.eps
        if native_takes(x, pre):
            collapsed = x.new_empty(x.shape[0], x.shape[-1])
            HC_COLLAPSE_INTO(collapsed, pre, x)
            return as_dtype(collapsed, streams.dtype)
        return as_dtype(torch.einsum("tn,tnh->th", pre, x), streams.dtype)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)``: on the CPU one native op whose value for an element is the same
    whatever the tensor's size and the CPU's instruction set (ATen's vector body and scalar
    tail round differently, so a graph padded to its capture size would not equal eager)."""
    if native_takes(x):
        out = torch.empty_like(x)
        SIGMOID_INTO(out, x)
        return out
    return torch.sigmoid(x)
