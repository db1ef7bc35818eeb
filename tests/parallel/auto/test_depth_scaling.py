"""The screen prices a deep candidate on two shallow copies of its model and extrapolates to its
depth (parallel/auto/search/depth_scaling.py): the copies are the ones it says, planned as the
full model would be, and the extrapolated figures agree with planning every block with the same
request. An eight-block LLaMA of width 64 on a fake world of 4 ranks (h100 profile)."""

import dataclasses

import pytest

from parallel.auto.search import point as sweep_point
from parallel.auto.search.depth_scaling import SCREEN_DEPTHS, full_depth, scales, shallow_copies
from parallel.auto.search.mesh_search import search_points
from parallel.auto.search.screen import screened
from trainer.auto_mode import base_job
from trainer.config import load_config

JOB = ["--model.n_layers", "8", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.ffn_hidden_dim", "128", "--model.vocab_size", "256", "--training.seq_len", "32",
       "--training.local_batch_size", "2", "--training.global_batch_size", "8"]


def _points(job_args=JOB, config="llama3_debug_auto"):
    return search_points(base_job(load_config(config, job_args, validate=False)), 4, "h100", pipelines=True)


def _point(label, pipeline="", n_layers=8):
    job = ["--model.n_layers", str(n_layers), *JOB[2:]]
    return next(p for p in _points(job)
                if p.mesh.label == label and (p.pipeline.label if p.pipeline else "") == pipeline)


def _layers_built(monkeypatch) -> list[int]:
    """The n_layers of every model the planner builds from now on (no trace kept from before)."""
    monkeypatch.setattr(sweep_point, "_TRACES", {})
    monkeypatch.setattr(sweep_point, "_STAGES", {})
    built = []
    real = sweep_point.build_model

    def spy(name, flavor, **kw):
        built.append(kw.get("n_layers"))
        return real(name, flavor, **kw)

    monkeypatch.setattr(sweep_point, "build_model", spy)
    return built


@pytest.mark.slow
@pytest.mark.parametrize("mesh, pipeline, n_layers", [
    ("dp_shard=4", "", 8), pytest.param("dp_shard=2,tp=2", "", 8, marks=pytest.mark.slow),
    pytest.param("pp=2,dp_shard=2", "1F1B x2", 8, marks=pytest.mark.slow),  # two stages: both copies whole
    ("pp=2,dp_shard=2", "Interleaved1F1B x2", 14)])  # 4 stages: the deeper copy plans its middle ones only
def test_the_copies_extrapolate_to_the_full_depth(monkeypatch, mesh, pipeline, n_layers):
    point = screened(_point(mesh, pipeline, n_layers))
    assert point.depth_scaled
    built = _layers_built(monkeypatch)
    scaled = sweep_point.plan_point(point, None)
    # the two copies, not the model: blocks 2 and 3; a pipeline's stages 2 and 3 units each
    stages = 0 if not pipeline else 4 if pipeline.startswith("Interleaved") else 2
    assert built == ([2, 3] if not pipeline else [2 * stages - 2, 3 * stages - 2])
    full = sweep_point.plan_point(dataclasses.replace(point, depth_scaled=False), None)
    assert built[-1] == n_layers
    assert scaled["status"] == full["status"] == "ok"
    assert scaled["step_ms"] == pytest.approx(full["step_ms"], rel=0.02)
    if full["mem_gib"] is not None:  # model states: exact in the blocks
        assert scaled["mem_gib"] == pytest.approx(full["mem_gib"], rel=1e-6)
    assert scaled["tokens_per_s"] == pytest.approx(8 * 32 / (scaled["step_ms"] * 1e-3))


@pytest.mark.slow
def test_the_deeper_pipelined_copy_plans_its_middle_stages_only(monkeypatch):
    point = screened(_point("pp=2,dp_shard=2", "Interleaved1F1B x2", 14))
    solved = []
    real = sweep_point.PipelineStages.plan_distinct

    def spy(self, layout, only=None):
        solved.append((len(layout.stages), only))
        return real(self, layout, only)

    monkeypatch.setattr(sweep_point.PipelineStages, "plan_distinct", spy)
    sweep_point.plan_point(point, None)
    assert solved == [(4, None), (4, [1, 2])]  # the shallower copy whole, the deeper one's middle stages


def test_which_points_scale_and_their_depth():
    assert full_depth(_point("dp_shard=4")) == 8 and scales(_point("dp_shard=4"))
    piped = _point("pp=2,dp_shard=2", "1F1B x2")
    assert full_depth(piped) == 5  # (8 blocks + embedding + output) / 2 stages
    three_blocks = ["--model.n_layers", "3", *JOB[2:]]  # no deeper than the deeper copy: planned whole
    assert not any(scales(p) for p in _points(three_blocks) if not p.reject)
    assert min(SCREEN_DEPTHS) >= 2  # a pipelined copy's stage holds the embedding or the output and a block


def test_the_copies_are_planned_as_the_full_model():
    point = screened(_point("dp_shard=4"))
    # a tiny model keeps the forward's copies first (its states fit many times): left to the planner
    assert {c.request.runtime.reshard_after_forward for c in shallow_copies(point)} == {"auto"}
    # a device whose memory the full model's states outgrow solves resharding first and keeps it
    # (every block recomputed): the copies, small enough to keep, are fixed to reshard as it would
    small = dataclasses.replace(point.request, planner=point.request.planner.replace(
        memory_limit_gib=1e-4, memory_estimate=True))
    copies = shallow_copies(dataclasses.replace(point, request=small))
    assert {c.request.runtime.reshard_after_forward for c in copies} == {True}
    assert all(c.shallow and not c.depth_scaled for c in copies)


def test_deepseek_copies_keep_its_dense_blocks():
    args = ["--model.n_layers", "6", "--model.n_dense_layers", "1", "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--training.global_batch_size", "8"]
    point = next(p for p in _points(args, "deepseek_v3_debug_auto") if p.mesh.label == "dp_shard=4")
    assert full_depth(point) == 5  # the MoE blocks after the dense one
    assert [dict(c.model_args)["n_layers"] for c in shallow_copies(point)] == [1 + d for d in SCREEN_DEPTHS]
