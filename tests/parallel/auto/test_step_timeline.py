"""The step simulation's timeline (cost/simulate.py): the compute lane tiles the predicted step,
each collective sits on its mesh axis's lane at its link times, a collective drawn under the
compute it hides behind, exposed waits and the optimizer on the compute lane, forward and
backward told apart at the loss's tangent; the SVG drawn from it (plan/pictures/timeline.py)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

from parallel import _torch as T
from parallel.auto.api import fake_world
from parallel.auto.cost import CostModel
from parallel.auto.cost.comm import collective_time
from parallel.auto.cost.simulate import simulate_step
from parallel.auto.cost.timeline import COMPUTE_LANE, MeasuredStep
from parallel.auto.plan.pictures.timeline import timeline_svg
from parallel.auto.runtime.schedule import schedule_overlap


def _simulate(n_gather: int, overlap: float = 1.0):
    """w (a parameter of 'layers.7') gathered on dp while x @ x runs, then read; the loss's
    tangent starts a backward that reads the gathered w again."""
    from torch.distributed import _functional_collectives as funcol

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        group = mesh.get_group(0).group_name

        def step(w, x):
            gathered = funcol.all_gather_single(w, 0, (mesh, 0))
            y = x @ x
            loss = (y.sum() + gathered.sum())
            grad = torch.ones_like(loss) * gathered.mean() * x
            return loss, grad

        with T.FakeTensorMode():
            gm = make_fx(step, tracing_mode="fake")(torch.randn(n_gather), torch.randn(512, 512))
        schedule_overlap(gm)  # the wait moves past the matmul, to the first read of the gather
        cm = CostModel("h100", (2,), ("dp",))
        cm.hw = cm.hw.replace(comm_overlap=overlap)
        pred = simulate_step(gm, cm, {group: cm.links[0]}, optimizer_param_bytes=4 * n_gather,
                             optimizer_tensors=1, param_groups=["layers.7"])
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and T.op_name(n.target) == "mm")
    return pred, cm, cm.compute_cost(mm)


def _tiles(events, step_us):
    """Sorted by start, each event begins where the previous ended, from 0 to the step's end."""
    events = sorted(events, key=lambda e: e.start_us)
    assert events[0].start_us == 0.0
    for a, b in zip(events, events[1:]):
        assert b.start_us == pytest.approx(a.end_us, abs=1e-9)
    assert events[-1].end_us == pytest.approx(step_us)
    assert sum(e.us for e in events) == pytest.approx(step_us, rel=1e-9)


@pytest.mark.parametrize("n_gather", [1 << 16, 1 << 26])  # hidden behind the matmul / longer than it
def test_compute_lane_tiles_the_step_and_collectives_sit_at_their_link_times(n_gather):
    pred, cm, t_mm = _simulate(n_gather)
    tl = pred.timeline
    assert tl.lanes == [COMPUTE_LANE, "dp"] and tl.step_us == pred.step_us
    compute = [e for e in tl.events if e.lane == COMPUTE_LANE]
    _tiles(compute, pred.step_us)
    (gather,) = [e for e in tl.events if e.lane == "dp"]
    assert gather.start_us == 0.0 and gather.nbytes == 2 * 4 * n_gather  # issued first, its output's bytes
    assert gather.us == pytest.approx(collective_time("all_gather", gather.nbytes, cm.links[0])[0])
    assert gather.label.startswith("all_gather ") and gather.phase == "forward"
    waits = [e for e in compute if e.label.startswith("waiting for all_gather@dp")]
    assert sum(e.us for e in waits) == pytest.approx(pred.exposed_comm_us)
    first = compute[0]  # x @ x and its sum, run while the gather is on the link: the overlap drawn
    assert first.label.startswith("(top level) forward: 2 ops, top: mm ")  # no parameter read yet
    assert first.start_us == gather.start_us and first.us > t_mm
    if n_gather == 1 << 16:
        assert not waits and gather.end_us < first.end_us  # hidden under the compute
    else:
        assert waits[0].start_us == pytest.approx(first.end_us) and waits[0].end_us == pytest.approx(gather.end_us)
    opt = compute[-1]
    assert opt.phase == "optimizer" and opt.us == pytest.approx(pred.optimizer_us) and opt.end_us == tl.step_us


def test_phases_split_at_the_loss_tangent_and_name_the_layer():
    pred, _, _ = _simulate(1 << 16)
    tl = pred.timeline
    assert [p[0] for p in tl.phases] == ["forward", "backward", "optimizer"]
    for (_, _, end), (_, start, _) in zip(tl.phases, tl.phases[1:]):
        assert start == pytest.approx(end)  # one after the other
    backward = [e for e in tl.events if e.lane == COMPUTE_LANE and e.phase == "backward"]
    assert backward and any(e.label.startswith("layers.7 backward: ") for e in backward)  # reads the gathered w
    assert all(re.search(r": \d+ ops?, top: \w+ \d+ %$", e.label) for e in backward)


def test_driving_share_holds_the_compute_lane():
    pred, _, _ = _simulate(1 << 20, overlap=0.25)
    drive = [e for e in pred.timeline.events if e.lane == COMPUTE_LANE and e.label.startswith("driving")]
    assert len(drive) == 1 and drive[0].us == pytest.approx(pred.comm_cpu_us) and pred.comm_cpu_us > 0
    _tiles([e for e in pred.timeline.events if e.lane == COMPUTE_LANE], pred.step_us)


def test_svg_has_a_lane_per_axis_and_its_compute_events_sum_to_the_step():
    pred, _, _ = _simulate(1 << 26)
    page = timeline_svg(pred.timeline, MeasuredStep(step_us=2 * pred.step_us, steps=10, compute_us=pred.step_us,
                                                    comm_us=0.5 * pred.step_us))
    assert page.startswith("<svg") and 'class="timeline"' in page and "<script" not in page
    assert re.findall(r'class="lane" data-lane="([^"]+)"', page) == ["compute", "dp", "measured"]
    durations = [float(u) for u in re.findall(r'class="event" data-lane="compute" data-start-us="[^"]+" '
                                              r'data-us="([^"]+)"', page)]
    assert sum(durations) == pytest.approx(pred.step_us, rel=1e-6)
    assert page.count('class="event" data-lane="dp"') == 1 and "waiting for all_gather@dp" in page
    parts = re.findall(r'class="measured" data-part="(\w+)"', page)
    assert parts == ["compute", "comm", "other"]  # the split, and what it does not account for
    assert "measured / predicted = 2.00" in page
    alone = timeline_svg(None, MeasuredStep(step_us=1000.0, steps=5))  # a loaded plan, measured in a run
    assert re.findall(r'class="lane" data-lane="([^"]+)"', alone) == ["measured"]
    assert re.findall(r'class="measured" data-part="(\w+)"', alone) == ["step"] and "predicted" not in alone


def test_events_too_short_to_see_are_drawn_as_one_rectangle_that_keeps_their_time():
    """5,000 compute events of 1 µs and 2,000 collectives on a 5 ms axis (about 0.2 px each)."""
    from parallel.auto.cost.timeline import StepTimeline, TimelineEvent

    events = [TimelineEvent(COMPUTE_LANE, float(i), i + 1.0, f"layers.{i // 200} forward: 3 ops, top: mm 50 %",
                            "forward") for i in range(5000)]
    events += [TimelineEvent("dp", 2.5 * i, 2.5 * i + 1.0, "all_gather 1.0 MiB", "forward", 2**20)
               for i in range(2000)]
    page = timeline_svg(StepTimeline(5000.0, [COMPUTE_LANE, "dp"], events, [("forward", 0.0, 5000.0)]))
    compute = [float(u) for u in re.findall(r'data-lane="compute" data-start-us="[^"]+" data-us="([^"]+)"', page)]
    assert 100 < len(compute) < 600 and sum(compute) == pytest.approx(5000.0, rel=1e-6)
    gathers = re.findall(r'data-lane="dp" data-start-us="[^"]+" data-us="([^"]+)" data-phase="forward" '
                         r'data-bytes="(\d+)"', page)
    assert 100 < len(gathers) < 600 and sum(float(u) for u, _ in gathers) == pytest.approx(2000.0, rel=1e-6)
    assert sum(int(b) for _, b in gathers) == 2000 * 2**20  # busy time and bytes kept, idle gaps not drawn busy
    assert re.search(r"<title>\d+ events, [\d.]+ µs busy, ", page) and len(page) < 400_000


def test_timeline_json_round_trips_and_a_damaged_one_names_what_is_wrong():
    """What a plan file keeps of its simulated step: read back equal; a damaged entry is one
    ValueError naming the source and the entry, never half a timeline."""
    import json

    from parallel.auto.cost.timeline import StepTimeline

    tl = _simulate(1 << 16)[0].timeline
    d = json.loads(json.dumps(tl.to_json()))  # as a file holds it
    assert StepTimeline.from_json(d) == tl
    bad_event = {**d, "events": [*d["events"][:1], {"lane": "dp", "start_us": "soon"}]}
    with pytest.raises(ValueError, match=r"^saved: event 1 is not a timeline event \(\{'lane': 'dp'"):
        StepTimeline.from_json(bad_event, source="saved")
    other_lane = {**d, "events": [{**d["events"][0], "lane": "tp"}]}
    with pytest.raises(ValueError, match="event 0 is not a timeline event"):
        StepTimeline.from_json(other_lane)
    with pytest.raises(ValueError, match="'phases' must be"):
        StepTimeline.from_json({**d, "phases": [["warmup", 0, 1]]})
    for broken in ([1, 2], {**d, "extra": 1}, {"step_us": 1.0}):
        with pytest.raises(ValueError, match="not a step timeline"):
            StepTimeline.from_json(broken)
