"""Random straight-line tensor programs with eager breaks, for capture property tests.

A program runs over a register file of ``[T, H]`` tensors, starting from a static input ``x``.
Each instruction appends one register; a cache ``[S, H]`` is written in place through a static
index tensor (``index_copy_``, ``scatter_``) and read back by attention-like instructions.
A ``Break`` runs a nested block as an eager break: it reads the registers so far, may host-sync
(it is eager), and writes its last register into a buffer the graph allocated before the break
(eager work must write into caller-provided buffers). Breaks nest; a nested break runs inline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from hypothesis import strategies as st

from graphs import eager_break_during_capture

T, H, S = 3, 8, 8
OPS = (
    "linear",
    "add",
    "mul",
    "scale",
    "softmax",
    "reduce",
    "view",
    "slice",
    "index_copy",
    "scatter",
    "attend",
    "gather",
    "inplace",
    "tanh",
    "accumulate",
    "arange",
    "transpose_",
    "max",
    "literal",
    "where",
    "norm",
)
GPU_OPS = tuple(op for op in OPS if op != "literal")
"""A tensor literal inside a CUDA graph capture copies from pageable host memory: not allowed."""


@attrs.frozen
class Instr:
    op: str
    a: int
    b: int


@attrs.frozen
class Break:
    body: tuple[Instr | Break, ...]


Program = tuple[Instr | Break, ...]


class Weights(torch.nn.Module):
    """Parameters and a buffer the programs read (a registered module)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, H, H, generator=generator) / math.sqrt(H))
        self.register_buffer("scale", torch.rand(H, generator=generator) + 0.5)


@attrs.define
class Env:
    """The static inputs of a program: ``x``, the cache index ``idx`` and the ``cache``."""

    x: torch.Tensor
    idx: torch.Tensor
    cache: torch.Tensor

    @classmethod
    def random(cls, generator: torch.Generator, device: str = "cpu") -> Env:
        return cls(
            x=torch.randn(T, H, generator=generator).to(device),
            idx=torch.randperm(S, generator=generator)[:T].to(device),
            cache=torch.randn(S, H, generator=generator).to(device),
        )

    def clone(self) -> Env:
        return Env(x=self.x.clone(), idx=self.idx.clone(), cache=self.cache.clone())

    def overwrite_with(self, other: Env) -> None:
        """Copy ``other``'s values into this env's tensors, in place (static buffers)."""
        self.x.copy_(other.x)
        self.idx.copy_(other.idx)
        self.cache.copy_(other.cache)


def _step(instr: Instr, regs: list[torch.Tensor], env: Env, weights: Weights) -> torch.Tensor:
    a, b = regs[instr.a % len(regs)], regs[instr.b % len(regs)]
    op = instr.op
    if op == "linear":
        return torch.tanh(a @ weights.w[instr.b % 2].t())
    if op == "add":
        return a + b
    if op == "mul":
        return a * b * 0.5
    if op == "scale":
        return a * weights.scale
    if op == "softmax":
        return torch.softmax(a * 2.0, dim=-1)
    if op == "reduce":
        kind = instr.b % 3
        if kind == 0:
            return a - a.mean(dim=-1, keepdim=True)
        if kind == 1:
            return a - a.amax(dim=-1, keepdim=True)
        return a / (a.abs().sum(dim=0, keepdim=True) + 1.0)
    if op == "view":
        return a.view(T, H // 2, 2).transpose(1, 2).reshape(T, H)
    if op == "slice":
        return torch.cat([a[:, H // 2 :], a[:, : H // 2] * 0.5], dim=1)
    if op == "index_copy":
        env.cache.index_copy_(0, env.idx, a)
        return env.cache[env.idx] + b
    if op == "scatter":
        env.cache.scatter_(0, env.idx[:, None].expand(T, H), b * 0.25)
        return a
    if op == "attend":
        scores = a @ env.cache.t() / math.sqrt(H)
        return torch.softmax(scores, dim=-1) @ env.cache
    if op == "gather":
        return env.cache.index_select(0, env.idx) * a
    if op == "inplace":
        t = a * 1.0
        t.mul_(0.5).add_(b)
        t[:, 0] = 1.0
        return t
    if op == "tanh":
        return torch.tanh(a + env.x)
    if op == "accumulate":  # a factory output mutated later must start fresh on every replay
        z = torch.zeros_like(a)
        z += a
        z[0] += b[0]
        return z
    if op == "arange":
        return a * torch.arange(H, dtype=a.dtype, device=a.device) / H
    if op == "transpose_":  # in-place view ops between uses of one tensor
        t = a + 1.0
        t.t_()
        t.mul_(b.t())
        t.t_()
        return t
    if op == "max":  # a multi-output op
        values, indices = a.max(dim=-1, keepdim=True)
        return a - values + indices.to(a.dtype)
    if op == "literal":  # a literal mutated later must start fresh on every replay
        c = torch.tensor(0.5)  # 0-dim: a literal of more dimensions cannot be captured
        c.add_(a[instr.b % T, 0])
        return a * c
    if op == "where":
        return torch.where(a > 0, a, 0.25)
    if op == "norm":
        return torch.nn.functional.layer_norm(a, (H,))
    raise AssertionError(op)


@eager_break_during_capture
def _eager_block(
    body: Program, regs: tuple[torch.Tensor, ...], out: torch.Tensor, env: Env, weights: Weights
) -> None:
    local = list(regs)
    execute(body, local, env, weights)
    sign = 1.0 if local[-1].sum().item() >= 0 else -1.0  # a host read: fine in an eager break
    out.copy_(local[-1] * sign)


def execute(program: Program, regs: list[torch.Tensor], env: Env, weights: Weights) -> None:
    for item in program:
        if isinstance(item, Break):
            out = torch.empty_like(regs[-1])
            _eager_block(item.body, tuple(regs), out, env, weights)
            regs.append(out)
        else:
            regs.append(_step(item, regs, env, weights))


def run(program: Program, env: Env, weights: Weights) -> list[torch.Tensor]:
    """Run ``program`` from ``env.x``; returns every register and, last, their sum (so every
    instruction's result reaches the output). ``env.cache`` is updated in place."""
    regs = [env.x]
    execute(program, regs, env, weights)
    return [*regs, torch.stack(regs).sum(dim=0)]


def count_breaks(program: Sequence[Instr | Break]) -> int:
    return sum(1 + count_breaks(i.body) for i in program if isinstance(i, Break))


def _nest(instrs: list[Instr], spans: list[tuple[int, int]]) -> Program:
    """Wrap ``instrs[start:end]`` of each span in a ``Break``; spans form a laminar family."""
    items: list[Instr | Break] = []
    i = 0
    while i < len(instrs):
        outer = [s for s in spans if s[0] == i]
        if outer:
            start, end = max(outer, key=lambda s: s[1] - s[0])
            inner = [(s - start, e - start) for s, e in spans if (s, e) != (start, end)]
            inner = [(s, e) for s, e in inner if s >= 0 and e <= end - start]
            items.append(Break(_nest(instrs[start:end], inner)))
            i = end
        else:
            items.append(instrs[i])
            i += 1
    return tuple(items)


@st.composite
def programs(draw: st.DrawFn, max_breaks: int = 3, ops: Sequence[str] = OPS) -> Program:
    """1-12 instructions with 0-``max_breaks`` eager breaks at random spans, some nested."""
    instrs = draw(
        st.lists(
            st.builds(
                Instr,
                op=st.sampled_from(tuple(ops)),
                a=st.integers(0, 16),
                b=st.integers(0, 16),
            ),
            min_size=1,
            max_size=12,
        )
    )
    spans: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(0, max_breaks))):
        start = draw(st.integers(0, len(instrs) - 1))
        end = draw(st.integers(start + 1, len(instrs)))
        laminar = all(
            end <= s or e <= start or (s <= start and end <= e) or (start <= s and e <= end)
            for s, e in spans
        )
        if laminar and (start, end) not in spans:
            spans.append((start, end))
    return _nest(instrs, spans)
