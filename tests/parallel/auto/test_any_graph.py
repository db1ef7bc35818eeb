"""The planner on graphs of models nobody here wrote (torch's own Transformer, TransformerEncoder
with a padding mask, MultiheadAttention stacks), on lifted constants (get_attr), factory ops
and copies, and on data-dependent reads: folded when the value is a constant, refused with
the op and the module when it depends on data. Fake meshes of 8 and 2x4; the coverage report
lists no unhandled op."""

import pytest
import torch
import torch_models as tm
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from parallel.auto.api import AutoParallel, fake_world
from parallel.auto.candidates.coverage import coverage_report
from parallel.auto.candidates.placements import placement_str
from parallel.auto.config import PlannerConfig
from parallel.auto.trace.fold import DataDependentError
from parallel.auto.trace.joint import trace_joint

PLANNED = ("seq2seq", "padded_encoder", "attention_stack", "relative_bias")


def _plan_all(shape, names, **solver):
    """Coverage and plan of every PLANNED model; placements are asserted, not the peak (no
    memory estimate); `solver`: PlannerConfig's solver settings."""
    out = {}
    with fake_world(8):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for name in PLANNED:
            with AutoParallel(tm.build(name), lambda name=name: tm.inputs(name), mesh,
                              planner=PlannerConfig(hardware="h100", memory_estimate=False, **solver)) as autop:
                out[name] = (autop.coverage(), autop.optimize_placement(verbose=False))
    return out


# 2x4: any valid plan serves (the default budget shards every weight whatever the solver):
# the MRF with a 1 s budget, ~19 s instead of the ILP's ~33 s (same objectives here)
@pytest.fixture(scope="module", params=[((8,), ("dp",), {}),
                                        pytest.param(((2, 4), ("dp", "tp"), {"solver": "mrf", "time_limit": 1.0}),
                                                     marks=pytest.mark.slow)],
                ids=["mesh8", "mesh2x4"])
def planned(request):
    shape, names, solver = request.param
    return shape, _plan_all(shape, names, **solver)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLANNED)
def test_torch_models_plan_with_full_coverage(planned, name):
    shape, results = planned
    cov, plan = results[name]
    print(f"{name} on {shape}:\n{cov}")
    assert cov.ok and "unhandled: none" in str(cov)
    assert cov.handled_as("replicate fallback") == []  # every op has DTensor strategies
    assert "aten.mm.default" in cov.handled_as("DTensor rule")
    # parameters fully sharded by default: no weight matrix is replicated on every mesh axis
    weights = {fqn: pl for fqn, pl in plan.param_placements().items() if fqn.endswith("weight") and "norm" not in fqn}
    replicated = placement_str((Replicate(),) * len(shape))
    assert weights and all(pl != replicated for pl in weights.values()), weights


def test_causal_mask_check_is_folded(planned):
    """nn.Transformer asks `bool((mask == causal).all())` of the tgt_mask made in forward: the
    mask is a constant, so the read is folded (True) and attention runs causal."""
    cov, _ = planned[1]["seq2seq"]
    assert [(f.module, f.value) for f in cov.folded] == [("transformer.decoder", "True")]
    assert all(f.where.startswith("transformer.py:") for f in cov.folded)


def test_lifted_constant_is_a_replicated_input(planned):
    shape, results = planned
    cov, plan = results["relative_bias"]
    assert cov.handled_as("lifted constant") == ["get_attr _tensor_constant0"]
    consts = [n for n in plan.nodes.values() if n.label.startswith("constant _tensor_constant0")]
    assert len(consts) == 2  # read in the forward (embedding) and the backward (embedding_dense_backward)
    assert all(n.output_placements == [placement_str((Replicate(),) * len(shape))] for n in consts)
    emb = next(n for n in plan.nodes.values() if n.target == "aten.embedding.default")
    assert consts[0].name in emb.inputs


def test_factory_ops_copies_and_literals():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        cov = coverage_report(trace_joint(tm.build("factory_ops"), tm.inputs("factory_ops")), mesh)
    print(cov)
    assert cov.ok and cov.handled_as("replicate fallback") == []
    constants = set(cov.handled_as("constant"))
    for op in ("lift_fresh_copy.default", "full.default", "arange.default", "scalar_tensor.default",
               "empty.memory_format", "fill.Scalar"):
        assert f"aten.{op}" in constants, op
    assert cov.handled_as("lifted constant") == ["get_attr _tensor_constant0"]  # the torch.tensor literal
    rules = set(cov.handled_as("DTensor rule"))
    assert {"aten.copy.default", "aten.new_zeros.default", "aten.slice_scatter.default"} <= rules


class _Gate(nn.Module):
    def forward(self, x):
        return x * (1.0 if x.abs().max().item() > 0 else 0.0)  # reads a value of the data


class _ReadsData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.lin(x)).pow(2).mean()


class _ReadsConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        n = int(torch.arange(4).sum())  # 6, from constants only
        acc = torch.zeros(())
        acc += x.sum()  # a constant changed in place by data: no longer a constant
        y = self.lin(x) * n
        return y.pow(2).mean() + (acc if acc.ndim == 0 else 0)


def test_read_of_data_is_refused_naming_module_and_line():
    with pytest.raises(DataDependentError, match=r"item \(aten._local_scalar_dense.default\) in module 'gate'") as e:
        trace_joint(_ReadsData(), (torch.randn(4, 8),))
    print(e.value)
    assert "at test_any_graph.py:" in str(e.value) and "Fix:" in str(e.value)


def test_mask_given_as_input_is_refused():
    """The same causal check on a mask that is an input: its value is unknown while planning."""
    class Seq2SeqMaskInput(tm.Seq2Seq):
        def forward(self, src, tgt, mask, labels):
            return tm._loss(self.head(self.transformer(src, tgt, tgt_mask=mask)), labels)

    src, tgt, labels = tm.inputs("seq2seq")
    mask = nn.Transformer.generate_square_subsequent_mask(tm.S)
    with pytest.raises(DataDependentError, match="module 'transformer.decoder'.*tgt_is_causal"):
        trace_joint(Seq2SeqMaskInput(), (src, tgt, mask, labels))


def test_fold_uses_the_value_and_forgets_constants_changed_by_data():
    jg = trace_joint(_ReadsConstants(), (torch.randn(4, 8),))
    assert [(f.op, f.module, f.value) for f in jg.folded] == [("TensorBase.__int__", "", "6")]
    muls = [n for n in jg.gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor or
            n.target == torch.ops.aten.mul.Scalar]
    assert any(6 in n.args for n in muls)  # the folded value is in the graph as a constant

    class _BadRead(_ReadsConstants):
        def forward(self, x):
            acc = torch.zeros(())
            acc += x.sum()
            return self.lin(x).mean() * (2.0 if bool(acc > 0) else 1.0)

    with pytest.raises(DataDependentError, match="in module '\\(root\\)'"):
        trace_joint(_BadRead(), (torch.randn(4, 8),))


def test_meta_constant_is_refused_naming_it():
    """A plain tensor attribute made on the meta device has no values anywhere: refused at trace time."""
    with torch.device("meta"):
        model = tm.RelativeBias()
    with pytest.raises(ValueError, match=r"buckets \(16, 16\) are on the meta device.*register_buffer"):
        trace_joint(model, tm.inputs("relative_bias"))


class _AssertsAsync(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        torch._assert_async(y.abs().sum() >= 0, "negative")  # a side effect: returns no tensor
        return y.pow(2).mean()


def test_unplaceable_node_is_listed_then_refused():
    from parallel.auto.candidates.strategies import UnsupportedGraphError, build_candidates

    jg = trace_joint(_AssertsAsync(), (torch.randn(8, 8),))
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        cov = coverage_report(jg, mesh)
        assert not cov.ok and [u.op for u in cov.unhandled] == ["aten._assert_async.msg"]
        assert "unhandled (planning refuses the graph):\n  aten._assert_async.msg (node _assert_async)" in str(cov)
        with pytest.raises(UnsupportedGraphError, match=r"(?s)1 node\(s\).*aten._assert_async.msg.*coverage_report"):
            build_candidates(jg, mesh)
