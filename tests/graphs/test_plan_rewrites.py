"""Plans that replay an op faster than its ``out=`` form, and must stay bitwise-equal to it.

- Number operands of arithmetic replayed as 0-dim tensors (``number_operand``): for every
  arithmetic op, in-place or not, every dtype and any number, the replayed step equals eager bit
  for bit on new inputs. Where the dtype computes in its own precision the plan passes the number
  as a tensor; for reduced floats (which compute in fp32 and read the number unrounded) it must
  not.
- ``mean`` replayed as ``sum`` then a division (``SumThenDivide``): equal to eager bit for bit
  over random shapes, reduced dims and dtypes; chosen exactly for CPU fp32/fp64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import BreakableCapture, TapeBackend
from graphs.tape import TapeSegment
from graphs.tape.planning import plan_functional
from graphs.tape.steps import SumThenDivide

OPS: dict[str, Callable[[torch.Tensor, float | int], torch.Tensor]] = {
    "add": lambda x, n: x + n,
    "sub": lambda x, n: x - n,
    "mul": lambda x, n: x * n,
    "div": lambda x, n: x / n,
    "add_": lambda x, n: x.clone().add_(n),
    "sub_": lambda x, n: x.clone().sub_(n),
    "mul_": lambda x, n: x.clone().mul_(n),
    "div_": lambda x, n: x.clone().div_(n),
    "remainder": lambda x, n: x % n,
    "floor_divide": lambda x, n: x // n,
    "remainder_": lambda x, n: x.clone().remainder_(n),
    "floor_divide_": lambda x, n: x.clone().floor_divide_(n),
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
OWN_PRECISION = {torch.float32, torch.float64, torch.int64, torch.int32}

numbers = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).filter(lambda v: v != 0),
    st.integers(min_value=-1000, max_value=1000).filter(lambda v: v != 0),
)


def _inputs(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 100
    return values.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.view(width), b.view(width)))
    return bool(torch.equal(a, b))


def _steps(segment: object) -> tuple[object, ...]:
    assert isinstance(segment, TapeSegment)
    return segment._steps


@given(
    op=st.sampled_from(sorted(OPS)),
    dtype=st.sampled_from(DTYPES),
    number=numbers,
    seed=st.integers(0, 2**16),
)
def test_number_operands_replay_like_eager(
    op: str, dtype: torch.dtype, number: float | int, seed: int
) -> None:
    if not dtype.is_floating_point:
        if op.startswith("div"):
            return  # true division of integers changes dtype or is rejected in place
        number = int(number) or 1  # integer division by zero raises eagerly too
    program = OPS[op]
    x = _inputs(dtype, seed)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = program(x, number)
        x.copy_(_inputs(dtype, seed + 1))
        capture.replay()
        assert _same_bits(out, program(x.clone(), number))


@pytest.mark.parametrize("dtype", DTYPES[:4])
@pytest.mark.parametrize("op", ["mul", "add_"])
def test_number_is_passed_as_a_tensor_only_where_the_dtype_computes_in_itself(
    op: str, dtype: torch.dtype
) -> None:
    x = _inputs(dtype, 0)
    with torch.inference_mode(), BreakableCapture(TapeBackend()) as capture:
        OPS[op](x, 0.1)
    plans = [
        step
        for step in _steps(capture.segments[0])
        if getattr(step, "func", None) in (torch.mul, torch.Tensor.add_)
    ]
    assert len(plans) == 1
    (step,) = plans
    number = step.args[1]  # type: ignore[attr-defined]
    if dtype in OWN_PRECISION:
        assert isinstance(number, torch.Tensor) and number.dtype == dtype and number.dim() == 0
    else:
        assert number == 0.1


@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    data=st.data(),
    keepdim=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_mean_replays_like_eager(
    shape: list[int], data: st.DataObject, keepdim: bool, dtype: torch.dtype, seed: int
) -> None:
    dims = data.draw(
        st.none() | st.sets(st.integers(0, len(shape) - 1), min_size=1), label="dims (None: all)"
    )

    def mean(x: torch.Tensor) -> torch.Tensor:
        return x.mean() if dims is None else x.mean(dim=sorted(dims), keepdim=keepdim)

    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 100).to(dtype)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = mean(x)
        x.copy_(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))
        capture.replay()
        assert _same_bits(out, mean(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_mean_is_sum_then_divide_only_in_dtypes_that_compute_in_themselves(
    dtype: torch.dtype,
) -> None:
    x = _inputs(dtype, 3)
    with torch.inference_mode():
        out = x.mean(dim=[1], keepdim=True)
        plan = plan_functional(torch.ops.aten.mean.dim, (x, [1], True), {}, [out], (0,), {})
    assert isinstance(plan, SumThenDivide) == (dtype in OWN_PRECISION)
    if isinstance(plan, SumThenDivide):
        assert plan.count == 5
