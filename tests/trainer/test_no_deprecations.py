"""The main job's path calls no deprecated torch API: on 2 gloo ranks, the hardware
calibration's collectives (what `hardware = "auto"` measures), a manual (FSDP2) job and an
auto-mode job, with the profiler on, train a few steps of a tiny LLaMA while every warning
is recorded (tests/trainer/profiled_jobs.py); not one FutureWarning or DeprecationWarning
may appear.

Every warning is recorded, not only those attributed to our modules: torch's deprecated
collectives warn through its own `c10d_logger` wrapper, so a filter on `module=` (the
frame the warning is attributed to) would miss exactly the calls this test is about.
No torch-internal warning needed an exception (torch 2.13): ALLOWED is empty.
"""

import warnings

import pytest
from profiled_jobs import MODES, two_rank_profiled_jobs

ALLOWED: tuple[str, ...] = ()
"""Exact messages of torch-internal deprecation warnings our calls cannot avoid (none today)."""
DEPRECATIONS = (FutureWarning.__name__, DeprecationWarning.__name__)


def _deprecations(recorded) -> list[str]:
    return [f"{cat}: {msg} ({where})" for cat, msg, where in recorded if cat in DEPRECATIONS and msg not in ALLOWED]


@pytest.mark.slow
def test_main_path_prints_no_deprecation_warnings():
    _, results = two_rank_profiled_jobs()
    for rank, out in enumerate(results):
        assert all(out[m + "_steps"] == [1, 2, 3] for m in MODES), out
        for part in ("calibration", *MODES):
            found = _deprecations(out[part])
            assert found == [], f"rank {rank}, {part}:\n" + "\n".join(found)


def test_a_deprecated_collective_would_be_caught():
    """The check sees what torch's deprecated collectives raise (they warn from torch's own
    c10d_logger frame): the calls this test guards against are not filtered away."""
    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dist.all_gather_into_tensor(None, None)  # warns before it looks at its arguments
        except Exception:  # noqa: BLE001 - no process group here: only the warning matters
            pass
    found = _deprecations([(w.category.__name__, str(w.message), w.filename) for w in caught])
    assert any("all_gather_into_tensor" in f for f in found), found
