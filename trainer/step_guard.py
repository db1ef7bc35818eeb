"""What every rank agrees on at each step, so that a job stops cleanly instead of training on
garbage, hanging, or being killed mid-save.

* Non-finite values: before the optimizer step, the ranks agree whether the loss and the
  gradient norm are finite; if not, the step is skipped (`[training] skip_nonfinite_steps`)
  or the job stops, naming the step and the first parameter with a non-finite gradient. The
  optimizer never applies such a step, and a checkpoint is never written from non-finite
  weights.
* Preemption: SIGTERM asks for a stop; the ranks agree on it in the same exchange, finish
  the step, save a checkpoint and exit 0 (run the same command to resume).
* Stalled ranks: a heartbeat thread on each rank posts the time, step and phase to the job's
  store (torchrun's TCPStore) every second; when a collective times out (`[comm]
  timeout_s`), the ranks still alive read whose heartbeat went quiet and end the job with
  one line naming them (a stopped process posts nothing: its threads stop too). A rank hung
  inside a call while its heartbeat thread still beats is named too: each rank whose
  collective timed out posts so to the store, and a beating rank that never does (within
  a few seconds) never reached that collective; without such posts, the rank behind the
  others (a lower step, or an earlier phase) is named.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .errors import TrainingFault

logger = logging.getLogger("autotitan")
HEARTBEAT_KEY = "autotitan/heartbeat/{rank}"
HEARTBEAT_S = 0.5
QUIET_S = 5 * HEARTBEAT_S  # a heartbeat older than this: the rank has stalled
TIMEOUT_KEY = "autotitan/timed_out/{attempt}/{rank}"  # posted by each rank whose collective timed out
TIMEOUT_GRACE_S = 5.0  # how long a timed-out rank waits for the others (beating) to post theirs


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def first_nonfinite_parameter(model: torch.nn.Module, device: torch.device) -> Optional[str]:
    """The first parameter (in the model's order) whose gradient is not finite on any rank."""
    names = [n for n, _ in model.named_parameters()]
    first = len(names)
    for i, (_, p) in enumerate(model.named_parameters()):
        g = p.grad
        if g is not None and not bool(torch.isfinite(_local(g)).all()):
            first = i
            break
    if _distributed():
        t = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        first = int(t.item())
    return names[first] if first < len(names) else None


def nonfinite_weight(model: torch.nn.Module) -> Optional[str]:
    """The first parameter whose values are not finite on this rank (None: all finite)."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(_local(p.detach())).all()):
            return name
    return None


class StepGuard:
    """The per-step agreement of the ranks (see the module docstring)."""

    def __init__(self, skip_nonfinite_steps: int, rank: int, device: torch.device) -> None:
        self.skip_allowed = skip_nonfinite_steps
        self.skipped: list[str] = []  # what each skipped step was told (the log lines)
        self.rank, self.device = rank, device
        self.stop_requested = False  # set by SIGTERM on this rank
        self.stop = False  # agreed by every rank: finish this step, save, exit 0
        self.step, self.phase = 0, "setup"  # where this rank is (the heartbeat posts it)
        self._previous: Any = None
        self._beating = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def at(self, step: int, phase: str) -> None:
        """Where this rank is now (posted by the heartbeat, named when a collective times out)."""
        self.step, self.phase = step, phase

    # ------------------------------------------------------------------ signals
    def __enter__(self) -> "StepGuard":
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: preemption is not handled here
            self._previous = None
        store = _heartbeat_store() if _distributed() else None
        if store is not None:
            self._beating.set()
            self._thread = threading.Thread(target=self._beat, args=(store,), name="autotitan-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        self._beating.clear()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_S)
            self._thread = None

    def _beat(self, store: Any) -> None:
        key = HEARTBEAT_KEY.format(rank=self.rank)
        while self._beating.is_set():
            try:
                store.set(key, f"{time.time()}\t{self.step}\t{self.phase}")
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return
            time.sleep(HEARTBEAT_S)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ the step
    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, model: torch.nn.Module) -> bool:
        """Whether to apply the optimizer step (False: skip it); sets `stop` when any rank was
        asked to stop. Raises TrainingFault on a non-finite step beyond the allowed skips."""
        bad = not (bool(torch.isfinite(loss.detach()).all()) and bool(torch.isfinite(grad_norm).all()))
        flags = torch.tensor([float(bad), float(self.stop_requested)], device=self.device)
        if _distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.stop = bool(flags[1] > 0)
        if not flags[0] > 0:
            return True
        param = first_nonfinite_parameter(model, self.device)
        what = (f"non-finite loss or gradient norm (first non-finite gradient: {param})" if param
                else "non-finite loss (every gradient finite)")
        if len(self.skipped) < self.skip_allowed:
            self.skipped.append(f"step {step}: {what}: step skipped ({len(self.skipped) + 1} of "
                                f"training.skip_nonfinite_steps = {self.skip_allowed}); the optimizer and LR schedule "
                                "did not step")
            if self.rank == 0:
                logger.warning(self.skipped[-1])
            return False
        allowed = (f"all {self.skip_allowed} allowed skips used" if self.skip_allowed
                   else "training.skip_nonfinite_steps = 0")
        raise TrainingFault(f"step {step}: {what}; training stopped before the optimizer step ({allowed}), so "
                            "the weights and every checkpoint stay finite; lower optimizer.lr, check the data, or "
                            "set [training] skip_nonfinite_steps = N to skip up to N such steps")

    def check_weights(self, step: int, model: torch.nn.Module) -> None:
        """Before a save: refuse to write non-finite weights (TrainingFault)."""
        name = nonfinite_weight(model)
        flags = torch.tensor([float(name is not None)], device=self.device)
        if _distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            where = f" ({name})" if name else ""
            raise TrainingFault(f"step {step}: non-finite weights{where}: the checkpoint of step {step} was not "
                                "written; the previous complete checkpoint stays the latest; lower optimizer.lr")

    # ------------------------------------------------------------------ stalls
    def stalled(self, error: BaseException, timeout_s: float) -> TrainingFault:
        """The fault of a timed-out collective: the ranks whose heartbeat went quiet (with
        their last step and phase), else the ranks that never reached the collective the others
        timed out in (hung in a call, their heartbeat thread alive), where this rank waited, and
        what to do. Every rank that timed out says so in the store; the lowest reports."""
        store, world = _heartbeat_store(), dist.get_world_size()
        quiet, at = _heartbeats(store, world)
        timed_out = self._report_timeout(store, [r for r in range(world) if r not in quiet])
        hung = [r for r in range(world) if r not in quiet and r not in timed_out and r in at]
        if quiet:
            who = ", ".join(quiet.values())
        elif hung and timed_out:
            who = "no rank's heartbeat stopped; " + ", ".join(
                f"rank {r} never reached the collective the others timed out in (its heartbeat beats: at step "
                f"{at[r][0]}, in {at[r][1]})" for r in hung)
        else:
            who = behind(at)
        reporters = sorted(timed_out) or [r for r in range(world) if r not in quiet] or [self.rank]
        return TrainingFault(f"step {self.step}: a collective timed out after {timeout_s:g} s ([comm] timeout_s); "
                             f"stalled: {who}; rank {self.rank} waited in {self.phase} "
                             f"({str(error).strip().splitlines()[0][:160]}); the job ends: restart it (it resumes from "
                             "the latest complete checkpoint), or raise [comm] timeout_s if a step takes that long",
                             reporting_rank=min(reporters))

    def _report_timeout(self, store: Any, expected: list[int]) -> set[int]:
        """Post that this rank timed out; wait up to `TIMEOUT_GRACE_S` for the `expected` ranks
        (those whose heartbeat beats) to post theirs; the ranks that did."""
        if store is None:
            return {self.rank}
        key = TIMEOUT_KEY.format(attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank="{rank}")
        with contextlib.suppress(Exception):
            store.set(key.format(rank=self.rank), str(self.step))
        deadline, seen = time.time() + TIMEOUT_GRACE_S, {self.rank}
        while True:
            for r in expected:
                with contextlib.suppress(Exception):
                    if r not in seen and store.check([key.format(rank=r)]):
                        seen.add(r)
            if seen >= set(expected) or time.time() > deadline:
                return seen
            time.sleep(0.2)


def _heartbeats(store: Any, world: int) -> tuple[dict[int, str], dict[int, tuple[int, str]]]:
    """({rank: why} of the ranks whose heartbeat went quiet or never came, {rank: (step, phase)}
    of every rank that posted)."""
    now = time.time()
    quiet: dict[int, str] = {}
    at: dict[int, tuple[int, str]] = {}
    for r in range(world):
        try:
            t, s, ph = store.get(HEARTBEAT_KEY.format(rank=r)).decode().split("\t", 2)
            at[r] = (int(s), ph)
            if now - float(t) > QUIET_S:
                quiet[r] = f"rank {r} (silent for {now - float(t):.0f} s, last at step {s}, in {ph})"
        except Exception:  # noqa: BLE001 - a rank that never posted
            quiet[r] = f"rank {r} (never posted)"
    return quiet, at


PHASES = ("the forward and backward", "the gradient norm", "the step's agreement (finite values, stop requests)",
          "the optimizer step", "the validation", "the checkpoint save")
"""A step's phases in the order a rank goes through them (what `StepGuard.at` posts)."""


def behind(at: dict[int, tuple[int, str]]) -> str:
    """Every heartbeat still beats (a rank hung inside a call, its heartbeat thread alive): the
    ranks behind the others by their posted step, then phase (`PHASES` order)."""
    place = {r: (step, PHASES.index(ph) if ph in PHASES else len(PHASES)) for r, (step, ph) in at.items()}
    if len(set(place.values())) < 2:
        return "no rank's heartbeat stopped and every rank is at the same place (a collective slower than the timeout?)"
    low = min(place.values())
    late = sorted(r for r, p in place.items() if p == low)
    others = sorted({f"step {s}, in {ph}" for r, (s, ph) in at.items() if r not in late})
    ranks = ", ".join(f"rank {r} (at step {at[r][0]}, in {at[r][1]})" for r in late)
    return f"no rank's heartbeat stopped; behind the others: {ranks} (the others at {'; '.join(others)})"


def _heartbeat_store() -> Any:
    """A client of the job's store for the heartbeat (torchrun's TCPStore, from its env vars),
    or None without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store to reach: no heartbeat
        return None
