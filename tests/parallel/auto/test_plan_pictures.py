"""plan.html's pictures (plan/pictures/memory.py, placements.py): the memory bars sum to the
estimate's peak against its limit with the peak's phase marked, activations per block (with
what activation checkpointing recomputes); the placements map has a row per folded layer
group coloured by each axis's placement, a region cell with its contract for a CP plan, and
outlined cells on a diff; a loaded plan, and one written before the per-block figures, still
draws them."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from models import build_model
from parallel.auto.api import CP_ATTENTION, AutoParallel, fake_world, lm_loss, lm_loss_positions
from parallel.auto.config import PlannerConfig
from parallel.auto.cost.memory import OUTSIDE
from parallel.auto.plan import Plan
from parallel.auto.plan.html import plan_diff_html, plan_html
from parallel.auto.plan.pictures.memory import BAR_W, LEFT, block_rows, peak_bar
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.search import presets

pytestmark = pytest.mark.slow  # plans the debug LLaMA three times on fake worlds (~25 s)


def _plan(kind: str, ac: str = "none") -> Plan:
    model = build_model("llama3", "debug", device="meta", n_layers=3)
    tok = torch.zeros(8, 32, dtype=torch.long)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=RuntimeOptions(ac_mode=ac),
                      planner=PlannerConfig(hardware="h100", solver="mrf", time_limit=1.0)) as autop:
        autop.add_input_constraints([(Shard(0),), (Shard(0),)])
        getattr(presets, kind)(autop)
        return autop.optimize_placement(verbose=False)


def _cp_plan() -> Plan:
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    tok = torch.zeros(4, 64, dtype=torch.long)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with AutoParallel(model, (tok, tok, torch.zeros(64, dtype=torch.long)), mesh, loss_fn=lm_loss_positions,
                      regions=(CP_ATTENTION,), planner=PlannerConfig(hardware="h100", solver="mrf", time_limit=1.0,
                                                                     memory_estimate=False)) as autop:
        presets.context_parallel(autop, 1, [0])
        return autop.optimize_placement(verbose=False)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    with fake_world(4):
        return {"ddp": _plan("ddp"), "fsdp": _plan("fsdp", ac="full"), "cp": _cp_plan()}


def _elements(page: str, tag: str, cls: str) -> list[dict[str, str]]:
    """Attributes of each `<tag class="cls" ...>` of the page."""
    return [dict(re.findall(r'([\w-]+)="([^"]*)"', m)) for m in re.findall(rf'<{tag} ([^>]*class="{cls}"[^>]*)>', page)]


def test_memory_bar_sums_to_the_peak_against_the_limit_with_the_phase(plans):
    plan = plans["fsdp"]
    est = plan.memory
    page = plan_html(plan)
    assert "<h2>Memory at the peak</h2>" in page
    body = page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # SVG's namespace: a name, fetches nothing
    assert not any(bad in body for bad in ("http://", "https://", "<script", "<link", "url("))
    parts = _elements(page, "rect", "mem-part")
    assert [p["data-part"] for p in parts] == ["params", "grads", "optimizer", "activations", "transient"]
    assert sum(int(p["data-bytes"]) for p in parts) == est.peak_bytes
    limit = _elements(page, "g", "mem-limit")
    assert len(limit) == 1 and int(limit[0]["data-bytes"]) == est.limit_bytes  # h100's 80 GiB: off the scale
    assert limit[0]["data-on-scale"] == "0" and "off the scale" in page
    phases = {p["data-phase"]: p["data-peak"] for p in _elements(page, "rect", "mem-phase")}
    assert phases[est.phase] == "1" and sum(map(int, phases.values())) == 1
    assert f'data-phase="{est.phase}"' in page
    # a limit near the peak sits on the scale, where its bytes are
    near = dataclasses.replace(est, limit_bytes=int(est.peak_bytes * 1.5))
    bar = peak_bar(near)
    x = float(re.search(r'class="mem-limit"[^>]*><line x1="([\d.]+)"', bar).group(1))
    full = near.limit_bytes * 1.02
    assert x == pytest.approx(LEFT + near.limit_bytes * BAR_W / full, abs=0.01)
    widths = [float(r["width"]) for r in _elements(bar, "rect", "mem-part")]
    assert sum(widths) == pytest.approx(near.peak_bytes * BAR_W / full, abs=0.05)


def test_activations_per_block_and_what_recomputation_reads(plans):
    est = plans["fsdp"].memory
    assert est.recompute == "full" and set(est.saved_by_block) >= {"layers.0", "layers.1", OUTSIDE}
    assert sum(est.saved_by_block.values()) == est.saved_bytes
    assert sum(est.activations_by_block.values()) == est.activations_bytes
    assert set(est.recomputed_by_block) == {"layers.0", "layers.1", "layers.2"}  # full AC: every block
    assert plans["ddp"].memory.recompute == "none" and not plans["ddp"].memory.recomputed_by_block
    page = plan_html(plans["fsdp"])
    saved = _elements(page, "rect", "mem-saved")
    assert sum(int(r["data-bytes"]) * int(r["data-count"]) for r in saved) == est.saved_bytes
    at_peak = _elements(page, "rect", "mem-at-peak")
    assert sum(int(r["data-bytes"]) * int(r["data-count"]) for r in at_peak) == est.activations_bytes
    rec = _elements(page, "rect", "mem-recomputed")
    assert sum(int(r["data-bytes"]) * int(r["data-count"]) for r in rec) == sum(est.recomputed_by_block.values())
    assert "activation checkpointing: full" in page
    rows = block_rows(est)
    assert rows[-1][0] == OUTSIDE and sum(c for _, c, _ in rows) == len(set(est.saved_by_block)
                                                                       | set(est.activations_by_block)
                                                                       | set(est.recomputed_by_block))


def _map_rows(page: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for c in _elements(page, "rect", "map-cell") + _elements(page, "rect", "map-region"):
        out.setdefault(c["data-group"], []).append(c)
    return out


def test_map_folds_layers_and_colours_by_placement(plans):
    ddp, fsdp = plan_html(plans["ddp"]), plan_html(plans["fsdp"])
    for page in (ddp, fsdp):
        assert "<h2>Placements map</h2>" in page
        assert ">layers.0-2 ×3</text>" in page  # one row for the three repeated blocks, with its count
        assert set(_map_rows(page)) == {"layers.0-2", "(top level)"}
    cells = _elements(ddp, "rect", "map-cell")
    assert cells and {c["data-axis"] for c in cells} == {"dp_shard"}
    assert {c["data-kind"] for c in cells} == {"replicate"} and {c["data-grad"] for c in cells} == {"partial"}
    assert {c["fill"] for c in cells} == {"#d9d9d9"}
    sharded = [c for c in _elements(fsdp, "rect", "map-cell") if c["data-group"] == "layers.0-2"]
    assert {c["data-kind"] for c in sharded} == {"shard dim 0"} and {c["fill"] for c in sharded} == {"#4e79a7"}
    assert "attention.wq.weight on dp_shard: " in fsdp  # the words in the hover title


def test_region_cell_with_its_contract(plans):
    page = plan_html(plans["cp"])
    regions = _elements(page, "rect", "map-region")
    assert {r["data-axis"]: r["data-placement"] for r in regions} == {"dp": "S(0)", "cp": "S(2)"}
    assert {r["data-column"] for r in regions} == {"region causal_attention"}
    assert {r["data-group"] for r in regions} == {"layers.0-1"}
    assert re.search(r"<title>layers\.0-1 region causal_attention: \w+ on cp: takes \(S\(2\), S\(2\), S\(2\)\), "
                     r"gives \(S\(2\)\), all-gathers its inputs 1, 2", page)
    # planned without the estimate: the page says so instead of drawing empty bars
    assert "no memory estimate with this plan" in page and "mem-part" not in page


def test_diff_outlines_the_cells_that_differ(plans):
    page = plan_diff_html(plans["fsdp"], plans["ddp"], names=("fsdp", "ddp"))
    assert page.count('class="placement-map"') == 2 and page.count('class="memory-peak"') == 2
    changed = [c for c in _elements(page, "rect", "map-cell") if c["data-changed"] == "1"]
    assert len(changed) == len(_elements(page, "rect", "map-cell"))  # every parameter's placement differs
    assert 'class="map-changed"' in page
    same = plan_diff_html(plans["ddp"], plans["ddp"])
    assert 'class="map-changed"' not in same


def test_loaded_plan_and_old_json_still_draw(plans, tmp_path):
    plan = plans["fsdp"]
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert loaded.memory == plan.memory
    page = plan_html(loaded)
    assert _elements(page, "rect", "mem-part") and _elements(page, "rect", "map-cell")
    assert _elements(page, "rect", "mem-saved")
    d = json.loads(path.read_text())
    for key in ("activations_by_block", "saved_by_block", "recomputed_by_block", "recompute"):
        del d["memory"][key]  # written before the per-block figures were recorded
    old = Plan.from_json(d)
    page = plan_html(old)
    assert sum(int(p["data-bytes"]) for p in _elements(page, "rect", "mem-part")) == plan.memory.peak_bytes
    assert "activations per block: not recorded in this plan" in page and "mem-saved" not in page
