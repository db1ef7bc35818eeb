"""Which rank a timed-out collective names (trainer/step_guard.py), from what the ranks post to
the job's store: a rank whose heartbeat went quiet; else a beating rank that never said it timed
out (it never reached the collective: hung inside a call); else the rank behind the others."""

import time

import pytest

from trainer import step_guard
from trainer.step_guard import HEARTBEAT_KEY, TIMEOUT_KEY, StepGuard, behind


class Store:
    """A dict with TCPStore's get / set / check."""

    def __init__(self, items: dict[str, str]):
        self.items = dict(items)

    def get(self, key):
        return self.items[key].encode()

    def set(self, key, value):
        self.items[key] = value

    def check(self, keys):
        return all(k in self.items for k in keys)


def _fault(monkeypatch, beats: dict[int, tuple[float, int, str]], timed_out: list[int], rank: int = 0) -> str:
    now = time.time()
    items = {HEARTBEAT_KEY.format(rank=r): f"{now - age}\t{step}\t{ph}" for r, (age, step, ph) in beats.items()}
    items.update({TIMEOUT_KEY.format(attempt="0", rank=r): "1" for r in timed_out})
    monkeypatch.setattr(step_guard, "_heartbeat_store", lambda: Store(items))
    monkeypatch.setattr(step_guard.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(step_guard, "TIMEOUT_GRACE_S", 0.3)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    guard = StepGuard(0, rank, step_guard.torch.device("cpu"))
    guard.step, guard.phase = 4, "the optimizer step"
    fault = guard.stalled(RuntimeError("Timed out waiting 15000ms"), 15)
    return str(fault), fault.reporting_rank


def test_a_quiet_heartbeat_is_named(monkeypatch):
    text, reporter = _fault(monkeypatch, {0: (0.1, 4, "the optimizer step"), 1: (30, 4, "the optimizer step"),
                                          2: (0.1, 4, "the optimizer step")}, timed_out=[2])
    assert "stalled: rank 1 (silent for 30 s, last at step 4, in the optimizer step)" in text
    assert reporter == 0


def test_a_beating_rank_that_never_timed_out_is_named_and_does_not_report(monkeypatch):
    beats = {r: (0.1, 4, "the optimizer step") for r in range(3)}
    text, reporter = _fault(monkeypatch, beats, timed_out=[2], rank=1)
    assert ("stalled: no rank's heartbeat stopped; rank 0 never reached the collective the others timed out in "
            "(its heartbeat beats: at step 4, in the optimizer step)") in text
    assert reporter == 1  # the lowest rank that timed out prints the line, not the hung rank 0


@pytest.mark.parametrize(("places", "named"), [
    ({0: (6, "the forward and backward"), 1: (5, "the optimizer step"), 2: (6, "the forward and backward")},
     "behind the others: rank 1 (at step 5, in the optimizer step) (the others at step 6, in the forward and "
     "backward)"),
    ({0: (6, "the checkpoint save"), 1: (6, "the checkpoint save"), 2: (6, "the optimizer step")},
     "behind the others: rank 2 (at step 6, in the optimizer step)"),
    ({0: (6, "the optimizer step"), 1: (6, "the optimizer step")}, "every rank is at the same place"),
])
def test_without_timeout_posts_the_rank_behind_is_named(places, named):
    assert named in behind(places)
