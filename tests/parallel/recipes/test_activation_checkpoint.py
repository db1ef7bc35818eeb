"""Activation checkpointing: same losses/grads as no AC, lower activation memory.

Memory is measured with the dry run's MemoryTracker (live bytes of the tensors created
by the forward that are still alive at its end = what backward will read) on the debug
LLaMA 3 (4 layers, batch 2 x 128, fp32).
"""

import pytest
import torch

from models import build_model, cross_entropy_loss
from parallel.activation_checkpoint import apply_ac
from parallel.measure import MemoryTracker

MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


def _run(mode, option):
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device="cpu")
    apply_ac(model, mode, option)
    data = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(0))
    with MemoryTracker() as mem:
        loss = cross_entropy_loss(model(data[:, :-1]), data[:, 1:])
        saved = mem.current
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, saved, mem.peak, model


@pytest.fixture(scope="module")
def runs():
    return {m: _run(*m) for m in MODES}


def test_ac_keeps_fqns_and_numerics(runs):
    ref_loss, ref_grads, *_ = runs[("none", "op")]
    for mode, (loss, grads, *_rest) in runs.items():
        assert set(grads) == set(ref_grads), mode  # parameter names unchanged
        assert loss == ref_loss, mode
        diff = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
        assert diff == 0.0, (mode, diff)


def test_ac_lowers_activation_memory(runs):
    saved = {m: r[2] for m, r in runs.items()}
    peak = {m: r[3] for m, r in runs.items()}
    mib = {f"{m[0]}/{m[1]}": (round(saved[m] / 2**20, 1), round(peak[m] / 2**20, 1)) for m in MODES}
    print("activation MiB alive after forward / peak fwd+bwd:", mib)
    none, full, sel_op, sel_2 = (saved[m] for m in MODES)
    assert full < sel_op < none
    assert full < sel_2 < none
    assert peak[("full", "op")] < peak[("none", "op")]
    assert peak[("selective", "op")] < peak[("none", "op")]


def test_ac_bad_option():
    model = build_model("llama3", "debug", device="meta")
    with pytest.raises(ValueError, match="selective_ac_option"):
        apply_ac(model, "selective", "x")
