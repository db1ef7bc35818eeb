"""Planning says torch's "N sequential collectives" redistribute warning once, in our words.

DTensor warns once per mesh and axes that a redistribution over several mesh axes runs one
collective per axis; a planning run (every sweep point, every memory estimate) has its own
meshes, so a mesh search printed it dozens of times (issue 25). `planning` installs a filter
(parallel/_torch.py) that drops it and logs one line per process instead.
"""

from __future__ import annotations

import logging
import re

import pytest
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel import _torch
from parallel.auto.api import fake_world
from parallel.auto.config import PlannerConfig
from parallel.auto.request import PlanRequest, planning


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow
def test_planning_two_meshes_says_the_sequential_redistribute_warning_once_in_our_words():
    torch_log = logging.getLogger(_torch._REDISTRIBUTE_LOGGER)
    ours = logging.getLogger("parallel.auto")
    for f in [f for f in torch_log.filters if isinstance(f, _torch._SequentialRedistributeNote)]:
        torch_log.removeFilter(f)  # a fresh process's state: nothing said yet
    seen_torch, seen_ours = _Records(), _Records()
    torch_log.addHandler(seen_torch)  # behind the logger's filters: sees what would be printed
    ours.addHandler(seen_ours)
    old_levels = ours.level, torch_log.level
    ours.setLevel(logging.INFO)
    torch_log.setLevel(logging.WARNING)  # as in a fresh process (a test may have raised it)
    try:
        request = PlanRequest(local_batch_size=2, seq_len=64,
                              planner=PlannerConfig(hardware="h100", solver="mrf", time_limit=2.0))
        with fake_world(8):
            # names of this test alone: torch warns once per mesh and axes per process
            for shape, names in (((2, 4), ("dp_replicate", "tp")), ((4, 2), ("dp_shard", "tp"))):
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                with planning(build_model("llama3", "debug", device="meta"), mesh, request) as autop:
                    plan = autop.optimize_placement(verbose=False)
                assert plan.memory is not None  # the estimate ran: its step graph redistributes
    finally:
        torch_log.removeHandler(seen_torch)
        ours.removeHandler(seen_ours)
        ours.setLevel(old_levels[0])
        torch_log.setLevel(old_levels[1])
    torch_warnings = [r for r in seen_torch.records if r.getMessage().startswith(_torch._SEQUENTIAL_WARNING)]
    notes = [r.getMessage() for r in seen_ours.records if "one collective per axis" in r.getMessage()]
    assert torch_warnings == []
    assert len(notes) == 1, notes
    assert re.search(r"\d+ sequential all_(gather|reduce)s", notes[0]), notes[0]
