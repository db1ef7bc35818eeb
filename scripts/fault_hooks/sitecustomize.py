"""Fault injection for scripts/fault_matrix.py, from outside the trainer: Python imports this
module at start-up when its folder is on PYTHONPATH, and it acts only when AUTOTITAN_FAULT is
set. The library has no fault code of its own.

    AUTOTITAN_FAULT=kill_in_save:RANK:STEP   # SIGKILL this process while DCP writes step-STEP
                                             # (RANK: a rank number or "all"; an async save's
                                             # write runs in DCP's background thread: the kill
                                             # strikes while the next steps train)
    AUTOTITAN_FAULT=hang_in_step:RANK:STEP   # rank RANK never returns from its STEP-th optimizer
                                             # step (it sleeps; its other threads, the trainer's
                                             # heartbeat among them, go on)
    AUTOTITAN_FAULT_MARKER=FOLDER            # just before the fault, write FOLDER/rank-R-pid-P
                                             # (what fired, where): the proof that it fired
"""

import os

_SPEC = os.environ.get("AUTOTITAN_FAULT", "")


def _mark(text: str) -> None:
    folder = os.environ.get("AUTOTITAN_FAULT_MARKER")
    if folder:
        os.makedirs(folder, exist_ok=True)
        name = f"rank-{os.environ['RANK']}-pid-{os.getpid()}"
        with open(os.path.join(folder, name), "w") as f:
            f.write(f"{text}\n")


if _SPEC.startswith("kill_in_save:") and "RANK" in os.environ:
    import signal

    import torch.distributed.checkpoint as dcp

    _, _rank, _step = _SPEC.split(":")
    _write = dcp.FileSystemWriter.write_data

    def _killing_write(self, plan, planner):
        if f"step-{_step}.tmp" in str(self.path) and _rank in ("all", os.environ["RANK"]):
            _mark(f"kill_in_save rank {os.environ['RANK']} pid {os.getpid()} writing {self.path}")
            os.kill(os.getpid(), signal.SIGKILL)
        return _write(self, plan, planner)

    dcp.FileSystemWriter.write_data = _killing_write

if _SPEC.startswith("hang_in_step:") and _SPEC.split(":")[1] == os.environ.get("RANK"):
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _at = int(_SPEC.split(":")[2])
    _steps = [0]

    def _hang(optimizer, args, kwargs):
        _steps[0] += 1
        if _steps[0] == _at:
            _mark(f"hang_in_step rank {os.environ['RANK']} pid {os.getpid()} in optimizer step {_at}")
            while True:
                time.sleep(60)

    register_optimizer_step_pre_hook(_hang)
