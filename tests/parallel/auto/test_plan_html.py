"""plan.html: one self-contained page per plan (the step as a timeline, layer groups x mesh axes,
collectives, memory), rendered from a loaded plan too (without the pictures it cannot draw);
two plans side by side with the changed nodes; scripts/plan.py --html/--diff; the page opened
in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.cost.timeline import COMPUTE_LANE
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan.html import TOP, fmt_bytes, params_table, plan_diff_html, plan_html, save_html

pytestmark = pytest.mark.slow  # plans the debug LLaMA on a fake 2x2 (~15-20 s setup)

PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "tok_embeddings", "output")
WQ = "layers.0.attention.wq.weight"


def _plan(ddp: bool) -> Plan:
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    inputs = lambda: (torch.zeros(8, 64, dtype=torch.long),) * 2  # noqa: E731
    # any valid plan serves (the page is asserted, not the optimum): the MRF with a 1 s budget
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss,
                      planner=PlannerConfig(hardware="h100", solver="mrf", time_limit=1.0)) as autop:
        if ddp:  # DDP-like: every parameter replicated, memory no object
            autop.add_parameter_memory_constraint(high=1.0)
            for fqn in autop.graph.params:
                autop.add_node_constraint(fqn, (Replicate(), Replicate()))
        return autop.optimize_placement(verbose=False)


@pytest.fixture(scope="module")
def plans():
    with fake_world(4):
        yield _plan(ddp=False), _plan(ddp=True)


def _self_contained(page: str) -> None:
    page = page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # SVG's namespace names, fetches nothing
    for bad in ("http://", "https://", "<script", "<link", "@import", "url("):
        assert bad not in page, bad


def test_page_shows_axes_layer_groups_placements_collectives_memory(plans):
    plan, _ = plans
    page = plan_html(plan)
    _self_contained(page)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for axis in ("dp", "tp"):  # one column per mesh axis
        assert page.count(f'<th class="axis">{axis}</th>') == 1
    # one row per layer group (the two blocks collapse) plus the top-level parameters
    assert re.search(r'<th class="group" rowspan="\d+">layers\.0-1</th>', page)
    assert f'<th class="group" rowspan="3">{TOP}</th>' in page  # tok_embeddings, norm, output
    for name in PROJECTIONS:
        assert f"<code>{name}.weight</code>" in page
    stored = plan.placement(WQ)  # e.g. (S(0), S(0)): the parameter's storage and its gradient
    assert f"<code>{stored} → {plan.grad_placement(WQ)}</code>" in page
    assert page.count('<span class="tag">fwd</span>') == page.count('<span class="tag">bwd</span>') > 0
    assert re.search(r"stored <code>(S\(\d\)|R)</code>", page) and re.search(r"grad <code>(S\(\d\)|R)</code>", page)
    # collectives: the objective's per kind@axis, with bytes and µs, and one by one grouped by phase
    assert plan.comm_us
    for key, us in plan.comm_us.items():
        kind, _, axis = key.partition("@")
        assert (f'<td>{kind}</td><td>{axis}</td><td class="num">{fmt_bytes(plan.comm_bytes[key])}</td>'
                f'<td class="num">{us:,.1f}</td>') in page
    assert '<table class="collectives">' in page and "<td>fwd</td>" in page
    assert "parameter memory per device: 0.2500 of all parameter bytes = " in page
    assert f"<th>peak memory</th><td>{plan.memory.summary()}</td>" in page
    assert f"{plan.objective_us:,.1f} µs = compute {plan.compute_us:,.1f} µs" in page
    assert "h100" in page and "dp=2 × tp=2" in page and "solve" in page


def test_loaded_plan_renders_from_json(plans, tmp_path):
    plan, _ = plans
    plan.save(str(tmp_path / "plan.json"))
    loaded = Plan.load(str(tmp_path / "plan.json"))
    assert loaded.costs is None
    page = plan_html(loaded)
    _self_contained(page)
    assert params_table(loaded) == params_table(plan)  # the same picture without the problem
    assert "this one was loaded" in page and "parameter memory per device: 0.2500" in page
    path = tmp_path / "sub" / "plan.html"
    save_html(loaded, path)
    assert path.read_text(encoding="utf-8") == page and not list(tmp_path.glob("sub/*.tmp"))


def test_page_draws_the_planners_step_timeline_and_a_loaded_plan_says_why_not(plans, tmp_path):
    plan, _ = plans
    tl = plan.timeline  # simulated on the memory estimate's step graph while planning
    assert tl is not None and tl.lanes == [COMPUTE_LANE, "dp", "tp"] and tl.source == "cost model (h100)"
    assert sum(e.us for e in tl.events if e.lane == COMPUTE_LANE) == pytest.approx(tl.step_us, rel=1e-9)
    assert [p[0] for p in tl.phases] == ["forward", "backward", "optimizer"]
    assert any(e.label.startswith("layers.1 backward: ") for e in tl.events)
    page = plan_html(plan)
    assert re.search(r'<svg[^>]* class="timeline"', page).start() < page.index("<h2>Overview")
    assert 'class="cannot-draw' not in page and f"{tl.step_us / 1e3:,.1f} ms" in page
    # saved with the plan: a loaded plan draws the same step
    path = tmp_path / "plan.json"
    plan.save(str(path))
    d = json.loads(path.read_text())
    assert len(d["timeline"]["events"]) < 200 and len(path.read_text()) < 2 * len(json.dumps(plan.to_json()))
    loaded = Plan.load(str(path))
    assert loaded.timeline == tl
    page = plan_html(loaded)
    assert 'class="cannot-draw' not in page and re.findall(r'class="timeline"[^>]* data-step-us="([^"]+)"', page)
    # a plan file saved without one (before plans kept it): it loads, and its page says why there are no lanes
    del d["timeline"]
    old = Plan.from_json(d, source=str(path))
    assert old.timeline is None and old.placement_digest() == plan.placement_digest()
    page = plan_html(old)
    assert 'class="timeline"' not in page and 'data-lane="' not in page  # no empty lanes
    assert re.search(r'<p class="note cannot-draw" data-picture="timeline">The step as a timeline is not drawn: '
                     r"this plan was loaded from a JSON file without the step simulation", page)


def test_a_damaged_saved_timeline_is_the_files_one_line_error(plans, tmp_path):
    plan, _ = plans
    d = plan.to_json()
    d["timeline"]["events"][3] = {"lane": "compute", "start_us": None}
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError) as e:
        Plan.load(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: the saved step simulation is damaged ('timeline': event 3 is not a timeline "
                          "event") and "\n" not in msg


class _Lanes(HTMLParser):
    """The timeline SVG's lanes and events, from the DOM a browser rendered."""

    def __init__(self):
        super().__init__()
        self.svgs, self.lanes, self.events = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "timeline" in a.get("class", ""):
            self.svgs.append(a)
        elif tag == "rect" and a.get("class") == "lane":
            self.lanes.append(a["data-lane"])
        elif tag == "rect" and a.get("class") == "event":
            self.events.append(a)


def test_timeline_in_headless_chromium(plans, tmp_path):
    """The page as a browser renders it (Debian's chromium; CI installs it best-effort): a lane for
    compute and one per mesh axis, the compute lane's events summing to the predicted step."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (CI installs Debian's chromium: .ci/run)")
    plan, _ = plans
    path = tmp_path / "plan.html"
    save_html(plan, path)
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    shot = tmp_path / "plan.png"  # a screenshot for a person debugging this test, never in the repository
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1100,900", path.as_uri()], capture_output=True,
                   timeout=120, check=False)
    parsed = _Lanes()
    parsed.feed(dom)
    assert len(parsed.svgs) == 1 and parsed.lanes == [COMPUTE_LANE, *plan.mesh_axis_names]
    compute = [float(e["data-us"]) for e in parsed.events if e["data-lane"] == COMPUTE_LANE]
    predicted = float(parsed.svgs[0]["data-step-us"])
    assert predicted == pytest.approx(plan.timeline.step_us)
    assert sum(compute) == pytest.approx(predicted, rel=0.01)
    assert {e["data-lane"] for e in parsed.events} == {COMPUTE_LANE, *plan.mesh_axis_names}
    assert any(int(e["data-bytes"]) > 0 for e in parsed.events if e["data-lane"] != COMPUTE_LANE)


def test_ddp_plan_reduces_gradients_with_all_reduce(plans):
    _, ddp = plans
    assert set(ddp.param_placements().values()) == {"(R, R)"}
    page = plan_html(ddp)
    assert "grad <code>R</code>, all-reduce" in page and "reduce-scatter" not in page.split("Collectives")[0]


def test_diff_page_side_by_side_with_changed_nodes(plans):
    a, b = plans
    diff = a.diff(b)
    assert len(diff) > 0
    page = plan_diff_html(a, b, names=("sharded", "ddp"))
    _self_contained(page)
    assert '<div class="side">' in page and page.count('<table class="params">') == 2
    assert "<h2>sharded: " in page and "<h2>ddp: " in page
    assert f"{a.objective_us:,.1f}" in page and f"{b.objective_us:,.1f}" in page
    assert f"{len(diff)} nodes changed" in page
    # both steps as timelines, on one time axis (the slower plan's step spans the same width on both sides)
    steps = [float(x) for x in re.findall(r'class="timeline"[^>]* data-step-us="([^"]+)"', page)]
    assert steps == [a.timeline.step_us, b.timeline.step_us]
    assert re.findall(r'class="timeline"[^>]* data-t-max-us="([^"]+)"', page) == [str(max(steps))] * 2
    name, na, nb = diff.changed[0]
    assert f"<code>{name}</code>" in page
    assert page.count('class="changed"') > len(diff.changed[:500])  # listed, and cells highlighted
    assert "(R, R) → (R, R)" in page  # the DDP side's parameter and gradient


def _script():
    from tools import plan

    return plan


def test_script_writes_html_and_diff(plans, tmp_path, capsys):
    _, ddp = plans
    other = tmp_path / "ddp.json"
    ddp.save(str(other))
    args = ["--config", "llama3_debug", "--mesh", "2x2", "--axis-names", "dp,tp", "--hardware", "h100",
            "--model.n_layers", "2", "--seq-len", "64", "--local-batch-size", "4",
            "--solver", "mrf", "--time-limit", "1"]  # any valid plan serves: the MRF with a 1 s budget
    html_path, diff_path = tmp_path / "tmp" / "x.html", tmp_path / "diff.html"
    main = _script().main
    assert main(args + ["--html", str(html_path), "--out", str(tmp_path / "p.json")]) == 0
    page = html_path.read_text(encoding="utf-8")
    _self_contained(page)
    assert "layers.0-1" in page and '<th class="axis">tp</th>' in page
    assert "plan page written to" in capsys.readouterr().out
    # the diff against a saved plan, rendered from its JSON fields (its saved timeline included)
    assert main(args + ["--html", str(diff_path), "--diff", str(other)]) == 0
    page = diff_path.read_text(encoding="utf-8")
    assert "<h2>ddp.json: " in page and "<h2>this plan: " in page and "nodes changed" in page
    assert len(re.findall(r'<svg[^>]* class="timeline"', page)) == 2 and 'data-picture="timeline"' not in page
    with pytest.raises(SystemExit):
        main(args + ["--diff", str(other)])  # --diff needs --html
    # a saved plan's page, without planning (no config, no mesh)
    shown = tmp_path / "shown.html"
    assert main(["--show", str(other), "--html", str(shown)]) == 0
    page = shown.read_text(encoding="utf-8")
    _self_contained(page)
    assert len(re.findall(r'<svg[^>]* class="timeline"', page)) == 1 and "(R, R) → (R, R)" in page
    for bad in (["--show", str(other)], ["--show", str(other), "--html", "x.html", "--mesh", "2"], ["--mesh", "2"]):
        with pytest.raises(SystemExit):
            main(bad)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "is not a plan file (invalid JSON: "),
    ('{"format_version": 0, "nodes": []}', ": plan file format is not version "),
    ("[1, 2]", " is not a plan (a JSON object was expected)"),
    ('{"format_version": 1, "nodes": [], "timeline": {"step_us": 1}}', ": the saved step simulation is damaged "),
])
@pytest.mark.parametrize("flag", ["--diff", "--show"])
def test_script_refuses_a_damaged_or_other_version_plan_in_one_line(tmp_path, capsys, content, problem, flag):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    args = ["--html", str(tmp_path / "d.html"), flag, str(bad)]
    code = _script().main(args + (["--config", "llama3_debug", "--mesh", "2"] if flag == "--diff" else []))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith(f"error: {flag} {bad}") and problem in err, err
    assert not (tmp_path / "d.html").exists()
