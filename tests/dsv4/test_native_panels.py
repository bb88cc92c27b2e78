"""Products on weights packed in panels (``dsv4.panels``): ``Linear`` and ``GroupedLinear`` read
their copy for any number of float32 rows on one thread, in blocks of ``BLOCK_ROWS``. Each
output is one float32 sum of fused multiply-adds (within a float32 sum's bound of the float64
definition), a row's result does not depend on the rows beside it nor on how many there are (one
row alone equals its row among a hundred), and the copy is read only while the weight holds what
it was packed from."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.config import DeepseekV4Config
from dsv4.hyper import HyperConnection, HyperHead
from dsv4.layers import BLOCK_ROWS, SKINNY_ROWS, GroupedLinear, Linear
from dsv4.moe import Router
from dsv4.panels import PANEL, PanelCopies, pack_model, panel_width
from graphs import BreakableCapture, TapeBackend
from graphs.op_count import OpCounter
from graphs.static_memory import StaticMemory

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _linear(in_features: int, out_features: int, seed: int) -> Linear:
    module = Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    return module


def _ops(module: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    counter = OpCounter()
    with torch.inference_mode(), counter:
        module(x)
    return dict(counter.by_name)


@given(
    rows=st.integers(1, 2 * BLOCK_ROWS + 3),
    in_features=st.integers(1, 200),
    out_features=st.sampled_from([1, 5, 16, 24, 33, 63, PANEL, 2 * PANEL, 3 * PANEL]),
    spread=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_a_product_in_panels_is_within_a_float32_sums_bound_and_rows_are_independent(
    rows: int, in_features: int, out_features: int, spread: float, seed: int
) -> None:
    module = _linear(in_features, out_features, seed)
    assert module.pack_panels() == 4 * in_features * out_features
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * spread
    with torch.inference_mode():
        got = module(x)
        alone = [module(x[m : m + 1]) for m in range(rows)]
    assert _ops(module, x).get("linear_panels_into") == 1
    assert _ops(module, x[:1]).get("linear_panels_into") == 1
    exact = x.double() @ module.weight.double().T
    magnitude = x.double().abs() @ module.weight.double().abs().T
    assert bool(((got.double() - exact).abs() <= in_features * 2**-24 * magnitude).all())
    assert all(torch.equal(got[m], row[0]) for m, row in enumerate(alone))


def test_the_grouped_product_in_panels_is_each_groups_product() -> None:
    module = GroupedLinear(in_per_group=48, out_total=3 * PANEL * 2, groups=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
    module.pack_panels()
    x = torch.randn(2, 4, 3, 48, generator=generator)  # 8 rows of 3 groups
    assert _ops(module, x).get("linear_panels_into") == 1
    for g in range(3):
        alone = _linear(48, 2 * PANEL, 0)
        with torch.no_grad():
            alone.weight.copy_(module.weight[g * 2 * PANEL : (g + 1) * 2 * PANEL])
        alone.pack_panels()
        with torch.inference_mode():
            assert torch.equal(module(x)[:, :, g], alone(x[:, :, g].contiguous()))


def test_the_copy_is_read_only_while_the_weight_holds_what_it_was_packed_from() -> None:
    module = _linear(32, PANEL, seed=1)
    x = torch.randn(SKINNY_ROWS + 3, 32)
    assert "linear_panels_into" not in _ops(module, x)  # not packed: ATen's product
    module.pack_panels()
    with torch.inference_mode():
        before = module(x)
        with torch.no_grad():
            module.weight.mul_(-1.0)
        assert "linear_panels_into" not in _ops(module, x)  # written since: the weight is read
        torch.testing.assert_close(module(x), -before, rtol=1e-5, atol=1e-5)
    module.pack_panels()
    with torch.inference_mode():
        assert torch.equal(module(x), -before)  # the sums of the negated terms
    assert "weight_panels" not in module.state_dict()


def test_every_row_count_on_one_thread_reads_the_copy() -> None:
    module = _linear(16, 2 * PANEL, seed=2)
    pack_model(module)
    for rows in (1, SKINNY_ROWS, SKINNY_ROWS + 1, BLOCK_ROWS, 3 * BLOCK_ROWS + 1):
        assert _ops(module, torch.randn(rows, 16)).get("linear_panels_into") == 1
    assert "linear_panels_into" not in _ops(module, torch.randn(8, 32)[:, ::2])  # strided rows
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert "linear_panels_into" not in _ops(module, torch.randn(8, 16))
        assert pack_model(_linear(16, PANEL, seed=0)) == 0  # nothing reads a copy: none made
    finally:
        torch.set_num_threads(previous)


def test_weights_pack_into_whole_panels_or_one_narrow_panel() -> None:
    widths = [panel_width(c) for c in (PANEL, 3 * PANEL, 24, 1, 96, 0)]
    assert widths == [PANEL, PANEL, 24, 1, None, None]
    narrow = _linear(32, 24, seed=0)
    assert narrow.pack_panels() == 4 * 32 * 24 and narrow.weight_panels is not None
    assert narrow.weight_panels.shape == (1, 1, 32, 24)
    assert _linear(32, 96, seed=0).pack_panels() == 0  # wider than a panel, not a multiple
    with torch.inference_mode():  # an inference tensor's writes are not counted: never packed
        assert _linear(32, PANEL, seed=0).pack_panels() == 0


def test_a_graph_captured_on_a_copy_in_panels_replays_like_eager() -> None:
    module = _linear(40, PANEL, seed=3)
    module.pack_panels()
    x = torch.randn(SKINNY_ROWS + 2, 40)
    static = StaticMemory()
    static.register(x, "x")
    static.register_module(module, "linear")
    with torch.inference_mode():
        with BreakableCapture(TapeBackend(), static=static) as capture:  # audited
            out = module(x)
        for seed in (1, 2):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
            capture.replay()
            assert torch.equal(out, module(x.clone()))


def test_a_replay_reads_weights_written_in_place_after_capture_as_a_cuda_graph_does() -> None:
    """A CUDA graph reads its parameters' memory: a weight written in place after capture is
    what the next replay multiplies. The copy in panels stands for that memory: refreshed, it
    is packed again into the buffer the graph reads. Moved to new storage (``.data =``), the
    weight is not followed, as a CUDA graph keeps reading the old address."""
    module = _linear(40, PANEL, seed=4)
    copies = PanelCopies(module)
    assert len(copies) == 1 and module.pack_panels() > 0
    buffer = module.weight_panels
    x = torch.randn(SKINNY_ROWS + 2, 40)
    static = StaticMemory()
    static.register(x, "x")
    static.register_module(module, "linear")
    with torch.inference_mode():
        with BreakableCapture(TapeBackend(), static=static) as capture:
            out = module(x)
        capture.replay()  # (capture records; it does not compute)
        before = out.clone()
        assert copies.refresh() == 0  # nothing written: nothing packed
        with torch.no_grad():
            module.weight.mul_(-1.0)  # exact: every term, so every sum, negated
        capture.replay()
        assert torch.equal(out, before)  # not yet refreshed: the copy holds the old weights
        assert copies.refresh() == 1 and module.weight_panels is buffer  # the same buffer
        capture.replay()
        assert torch.equal(out, -before)  # the weights written since capture
        assert torch.equal(module(x.clone()), -before)  # eager reads the refreshed copy
        assert copies.refresh() == 0
    module.weight.data = torch.randn(PANEL, 40)  # moved, not written
    with torch.inference_mode():
        assert copies.refresh() == 0
        capture.replay()
        assert torch.equal(out, -before)  # the graph keeps the old memory
    assert module.pack_panels() > 0 and module.weight_panels is buffer  # packed in place
    with torch.inference_mode():
        capture.replay()
        assert torch.equal(out, module(x.clone()))  # now the moved weight's values


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return module


@pytest.mark.parametrize("tokens", [1, SKINNY_ROWS + 4])
def test_the_router_and_hyper_connections_read_their_copies_at_every_step_size(
    tokens: int,
) -> None:
    """One native op on the copy each: the router's and the head's products
    (``linear_panels_into``), the hyper-connection's norm, product, weights and collapse
    (``hc_pre_into``, which only ever reads a copy in panels)."""
    config = DeepseekV4Config.tiny()
    hidden, n = config.hidden_size, config.hc_mult
    router = _randomized(Router(config, hashed=False), 0)
    connection = _randomized(
        HyperConnection(
            n, hidden, sinkhorn_iters=config.hc_sinkhorn_iters, eps=1e-6, norm_eps=1e-6
        ),
        1,
    )
    head = _randomized(HyperHead(n, hidden, eps=1e-6, norm_eps=1e-6), 2)
    x, streams = torch.randn(tokens, hidden), torch.randn(tokens, n, hidden)
    calls = [
        (router, (x, torch.zeros(x.shape[0], dtype=torch.long)), "linear_panels_into"),
        (connection, (streams,), "hc_pre_into"),
        (head, (streams,), "linear_panels_into"),
    ]
    for module, args, operator in calls:
        with torch.inference_mode():
            before = module(*args)
        assert pack_model(module) > 0
        counter = OpCounter()
        with torch.inference_mode(), counter:
            after = module(*args)
        assert counter.by_name[operator] == 1, type(module).__name__
        for a, b in zip(
            before if isinstance(before, tuple) else (before,),
            after if isinstance(after, tuple) else (after,),
            strict=True,
        ):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(a, b)  # the router's choice
