"""An eager step graph runs a region's forward once and hands its autograd graph to the
backward (regions/tape.py), where the region's backward op alone would run the forward
again; the gradients are autograd's, a backward with no kept forward still recomputes, and
the memory estimate holds what the kept forward saves until the backward."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from parallel import _torch as T
from parallel.auto import regions
from parallel.auto.cost.memory import step_graph_memory
from parallel.auto.regions.tape import pair_region_calls, taped_bytes, use_region_tape

CALLS = {"n": 0}


def _gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    return torch.nn.functional.silu(x @ w) * (x @ w)


regions.declare(regions.Region("tape_gate", [regions.Option("rows", (Shard(0), Shard(0)), (Shard(0),))], fn=_gate))
FWD, BWD = regions.forward_op("tape_gate"), regions.backward_op("tape_gate")


def _graph(backward_x: str = "same") -> fx.GraphModule:
    """forward (x, w) -> y; a loss-like mul; backward of the region -> (dx, dw), given x
    itself, a copy of it (as a parameter gathered again) or a copy of another layout."""

    def step(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = FWD(x, w)
        out = y * 2.0
        again = {"same": x, "copy": x.clone(), "transposed copy": x.t().contiguous().t()}[backward_x]
        dx, dw = BWD(g * 2.0, again, w)
        return out, dx, dw

    return T.trace_fake(step)(torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5))


@pytest.mark.parametrize("backward_x", ["same", "copy"])
def test_the_forward_runs_once_and_the_gradients_are_autograds(backward_x):
    gm = _graph(backward_x)
    pairs = pair_region_calls(gm)
    assert [(f.target, b.target) for f, b in pairs] == [(FWD, BWD)]
    held = taped_bytes(pairs[0][0])
    assert held >= 2 * 6 * 5 * 4  # x @ w twice (or once) and the silu's input: at least two 6 x 5 fp32 saved

    tape = use_region_tape(gm)
    T.generate_code(gm)
    x, w, g = torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5)
    CALLS["n"] = 0
    out, dx, dw = gm(x, w, g)
    assert CALLS["n"] == 1, "the region's function ran again for its backward"
    assert tape.recomputed == 0 and not tape.kept

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _gate(xr, wr)
    (y * 2.0 * g).sum().backward()
    torch.testing.assert_close(out, y.detach() * 2.0)
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dw, wr.grad)


def test_a_backward_given_inputs_of_another_layout_recomputes():
    gm = _graph("transposed copy")
    assert pair_region_calls(gm) == []
    assert use_region_tape(gm) is None  # the graph is left as it was: the backward op recomputes
    CALLS["n"] = 0
    gm(torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5))
    assert CALLS["n"] == 2


def test_the_memory_estimate_holds_the_kept_forward_until_the_backward():
    gm = _graph()
    (fwd, bwd), = pair_region_calls(gm)
    kw = dict(n_inputs=2, n_outputs=1, state_bytes=0, optimizer_bytes=0, optimizer_temp=0)
    without = step_graph_memory(gm, **kw)
    held = taped_bytes(fwd)
    with_tape = step_graph_memory(gm, **kw, held=[(fwd, bwd, held)])
    assert with_tape.peak_bytes - without.peak_bytes == held


@pytest.mark.slow
def test_compiled_the_graph_breaks_at_the_regions_and_their_forward_still_runs_once():
    """torch.compile of the step graph: with the region ops inside the compiled graph the
    backward op runs the region's forward again; on the compiled tape the graph compiles in
    pieces between the region calls, which run eagerly with their forward kept."""
    x, w, g = torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _gate(xr, wr)
    (y * 2.0 * g).sum().backward()
    calls = {}
    for taped in (False, True):
        torch.compiler.reset()
        gm = _graph()
        tape = use_region_tape(gm, compiled=True) if taped else None
        T.generate_code(gm)
        fn = torch.compile(gm, fullgraph=not taped, dynamic=False)
        fn(x, w, g)  # compiles (its tracing may call the region's function on fake tensors)
        CALLS["n"] = 0
        out, dx, dw = fn(x, w, g)
        calls[taped] = CALLS["n"]
        torch.testing.assert_close(out, y.detach() * 2.0)
        torch.testing.assert_close(dx, xr.grad)
        torch.testing.assert_close(dw, wr.grad)
        if taped:
            assert tape.recomputed == 0 and not tape.kept
    assert calls == {False: 2, True: 1}, calls
