"""The measured step beside the predicted one: after the warm-up the trainer logs it, writes
it into the run's plan.html and into TensorBoard as scalars next to the prediction, and,
when the run profiles, splits it into compute and communication from the profiler's events
(2 gloo ranks in auto mode: one plan, one prediction). Manual mode has no prediction: the
measured scalars alone, no page."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from dist_utils import run_distributed
from trainer_helpers import make_config

TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "100", "--metrics.enable_tensorboard", "true", "--metrics.hardware", "h100",
        "--checkpoint.enable", "false"]


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _worker(rank: int, world: int, tmp: str, freq: int) -> dict:
    from trainer.config import load_config
    from trainer.trainer import Trainer

    profiled = ["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(freq)] if freq else []
    cfg = load_config("llama3_debug", [*TINY, "--training.steps", "8", "--parallelism.mode", "auto",
                                       "--parallelism.hardware", "cpu", *profiled, "--job.dump_folder", tmp,
                                       "--job.name", f"freq{freq}"], world_size=world)
    tr = Trainer(cfg)  # sets the trainer's logging up
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("autotitan").addHandler(handler)
    tr.train()
    return {"measured": tr.measured_step, "forecast_us": tr.forecast.step_us, "peak": tr.forecast.peak_bytes,
            "lines": [x for x in lines if x.startswith("step time:")]}


def _check_run(run: Path, out: dict) -> None:
    m = out["measured"]
    ms = f"{m.step_us / 1e3:,.1f} ms"
    assert f"measured {ms} (median of 5 steps" in out["lines"][0], out["lines"]
    assert re.search(r"measured / predicted = [\d.]+", out["lines"][0])
    page = (run / "plan.html").read_text()
    step = page[page.index("<h2>Step</h2>"):page.index("</table>", page.index("<h2>Step</h2>"))]
    assert f"<td class=\"num\">{ms}</td>" in step and "median of 5 steps" in step and "measured / predicted" in step
    tb = _scalars(run)
    assert tb["step_time/measured_ms"] == [(7, tb["step_time/measured_ms"][0][1])]
    assert abs(tb["step_time/measured_ms"][0][1] - m.step_us / 1e3) < 1e-3 * m.step_us / 1e3
    assert abs(tb["step_time/predicted_ms"][0][1] - out["forecast_us"] / 1e3) < 1e-3 * out["forecast_us"] / 1e3
    assert abs(tb["memory/predicted_peak_gib"][0][1] - out["peak"] / 2**30) < 1e-6
    for k in ("step_time/predicted_compute_ms", "step_time/predicted_comm_ms"):
        assert tb[k][0][1] > 0, k
    assert "memory/measured_peak_gib" not in tb and m.peak_bytes is None  # CPU: no allocator statistic


@pytest.mark.slow
def test_measured_step_in_plan_page_log_and_tensorboard_with_the_profilers_split(tmp_path):
    """profile_freq 4: step 4 is recorded inside the timed steps (3..7) and splits the step when
    it is measured; profile_freq 8: step 8 comes after it, and fills the split in then."""
    for freq, when in ((4, 7), (8, 8)):
        out = run_distributed(_worker, 2, str(tmp_path), freq, timeout=300)
        run = tmp_path / f"freq{freq}"
        _check_run(run, out[0])
        m = out[0]["measured"]
        assert all(o["measured"] == m for o in out)  # every rank holds the rank-averaged step
        assert m.source == f"timers; split: profiler, step {freq}" and m.comm_us > 0 and m.compute_us > 0
        tb = _scalars(run)
        assert tb["step_time/measured_comm_ms"] == [(when, tb["step_time/measured_comm_ms"][0][1])]
        assert abs(tb["step_time/measured_comm_ms"][0][1] - m.comm_us / 1e3) < 1e-3 * m.comm_us / 1e3
        assert f"profiler, step {freq}" in (run / "plan.html").read_text()
        # measured with its split (one line), or measured, then split when step 8 is recorded (two)
        assert len(out[0]["lines"]) == (1 if freq == 4 else 2) and f"profiler, step {freq}" in out[0]["lines"][-1]


@pytest.mark.slow
def test_cpu_run_measures_the_allocator_peak_on_the_step_after_the_timed_ones(tmp_path):
    """No profiler asked for: step 8 runs under the CPU allocator's window (steps 3..7 timed),
    its peak (the most of any rank, above the state alive before it) joins the measured step,
    TensorBoard and the page; the plan's estimate is checked by it within 25 %."""
    out = run_distributed(_worker, 2, str(tmp_path), 0, timeout=300)
    m, run = out[0]["measured"], tmp_path / "freq0"
    assert all(o["measured"] == m for o in out) and m.peak_bytes is not None
    assert m.source == "timers; peak: CPU allocator, step 8"
    assert 0.75 < m.peak_bytes / out[0]["peak"] < 1.25, (m.peak_bytes, out[0]["peak"])
    tb = _scalars(run)
    assert tb["memory/measured_peak_gib"] == [(8, m.peak_bytes / 2**30)] or \
        abs(tb["memory/measured_peak_gib"][0][1] - m.peak_bytes / 2**30) < 1e-6
    assert len(out[0]["lines"]) == 2 and "allocator peak" in out[0]["lines"][1]
    assert "peak: CPU allocator, step 8" in (run / "plan.html").read_text()


def test_manual_mode_writes_the_measured_scalars_only(tmp_path):
    from trainer.trainer import Trainer

    tr = Trainer(make_config(tmp_path, extra=[*TINY, "--training.steps", "4"]))
    tr.train()
    assert tr.forecast is None and tr.measured_step.steps == 2 and tr.measured_step.source == "timers"
    tb = _scalars(tmp_path / "run")
    assert [k for k in tb if k.startswith(("step_time/", "memory/"))] == ["step_time/measured_ms"]
    assert tb["step_time/measured_ms"][0][0] == 4
    assert not (tmp_path / "run" / "plan.html").exists()


def test_micro_batches_repeat_the_predicted_step_and_scalars_leave_out_what_nobody_gave():
    from parallel.auto.cost.timeline import MeasuredStep, StepTimeline, TimelineEvent
    from trainer.measured import StepForecast, repeated, step_scalars

    one = StepTimeline(10.0, ["compute", "dp"], [TimelineEvent("compute", 0, 6, "ops", "forward"),
                                                 TimelineEvent("dp", 6, 10, "all_reduce", "backward", 64)],
                       [("forward", 0, 6), ("backward", 6, 10)], "cost model (cpu)")
    three = repeated(one, 3)
    assert three.step_us == 30.0 and len(three.events) == 6 and three.lane_end_us("dp") == 30.0
    assert [(e.start_us, e.end_us) for e in three.events if e.lane == "compute"] == [(0, 6), (10, 16), (20, 26)]
    assert three.source == "cost model (cpu), 3 micro-batches" and repeated(one, 1) is one
    f = StepForecast(step_us=30e3, compute_us=12e3, comm_us=9e3, peak_bytes=2**31, words="cpu", timeline=three)
    m = MeasuredStep(step_us=45e3, steps=5)
    assert step_scalars(m, f) == {"step_time/measured_ms": 45.0, "step_time/predicted_ms": 30.0,
                                  "step_time/predicted_compute_ms": 12.0, "step_time/predicted_comm_ms": 9.0,
                                  "memory/predicted_peak_gib": 2.0}
    assert f.report(0.045).endswith("measured / predicted = 1.50")


def test_the_split_of_a_recorded_step_on_cuda_and_on_cpu():
    """Without a GPU: the profiler's events as step_split reads them (FunctionEvent's fields)."""
    from types import SimpleNamespace as NS

    import torch

    from parallel.measure import PHASE_PREFIX
    from trainer.profiling import step_split

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, device, start, end, self_us):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end),
                  self_cpu_time_total=self_us if device == cpu else 0,
                  self_device_time_total=self_us if device == cuda else 0)

    kernels = [ev("ampere_sgemm_128x64", cuda, 0, 300, 300), ev("ncclDevKernel_AllGather_RING_LL", cuda, 0, 120, 120),
               ev("aten::mm", cpu, 0, 40, 40), ev("nccl:all_gather", cpu, 0, 10, 10)]
    assert step_split(NS(events=lambda: kernels), cuda=True) == (300, 120)
    host = [ev(PHASE_PREFIX + "forward_backward", cpu, 100, 900, 5), ev(PHASE_PREFIX + "optimizer", cpu, 950, 1100, 5),
            ev("aten::mm", cpu, 120, 400, 280), ev("c10d::allreduce_", cpu, 500, 700, 200),
            ev("gloo:all_reduce", cpu, 500, 700, 0), ev("_c10d_functional::wait_tensor", cpu, 960, 1010, 50),
            ev("c10d::allreduce_", cpu, 1200, 1300, 100)]  # after the step's phases: a logging reduction
    assert step_split(NS(events=lambda: host), cuda=False) == (1000 - 250, 250)
