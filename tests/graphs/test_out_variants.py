"""``graphs.tape.out_variants`` finds each functional ATen operator's ``out=`` overload from
schemas alone: the overloads whose names are not ``.out`` among them, and the same answer as
torch's own private lookup on every ATen overload where this torch has one."""

from __future__ import annotations

import pytest
import torch

from graphs.tape.out_variants import out_names, out_variant

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("op", "expected", "names"),
    [
        (aten.add.Tensor, aten.add.out, ("out",)),
        (aten.pow.Tensor_Scalar, aten.pow.Tensor_Scalar_out, ("out",)),
        (aten.le.Tensor, aten.le.Tensor_out, ("out",)),
        (aten.where.self, aten.where.self_out, ("out",)),
        (aten.max.dim, aten.max.dim_max, ("max", "max_values")),
        (aten.add_.Tensor, None, ()),  # in place: no out= form
        (aten.add.out, None, ()),  # writes already
    ],
)
def test_the_out_overload_of_a_functional_op(
    op: torch._ops.OpOverload, expected: torch._ops.OpOverload | None, names: tuple[str, ...]
) -> None:
    assert out_variant(op) == expected
    if expected is not None:
        assert out_names(expected) == names


def test_every_aten_overload_agrees_with_torchs_own_lookup() -> None:
    private = pytest.importorskip("torch._library._out_variant")
    if not hasattr(private, "to_out_variant"):
        pytest.skip("this torch has no lookup of its own to compare with")
    compared = 0
    for name in dir(aten):
        packet = getattr(aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            try:
                theirs = private.to_out_variant(op)
            except RuntimeError:  # theirs refuses a non-functional schema; ours says None
                theirs = None
            assert out_variant(op) == theirs, op
            compared += 1
    assert compared > 1000
