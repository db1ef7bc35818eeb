"""Fault injection for scripts/fault_matrix.py, from outside the trainer: Python imports this
module at start-up when its folder is on PYTHONPATH, and it acts only when AUTOTITAN_FAULT is
set. The library has no fault code of its own.

    AUTOTITAN_FAULT=kill_in_save:RANK:STEP   # SIGKILL this process while DCP writes step-STEP
                                             # (RANK: a rank number or "all"; an async save's
                                             # write runs in DCP's background thread: the kill
                                             # strikes while the next steps train)
    AUTOTITAN_FAULT_MARKER=FOLDER            # just before the kill, write FOLDER/rank-R-pid-P
                                             # (what fired, where): the proof that it fired
"""

import os

_SPEC = os.environ.get("AUTOTITAN_FAULT", "")

if _SPEC.startswith("kill_in_save:") and "RANK" in os.environ:
    import signal

    import torch.distributed.checkpoint as dcp

    _, _rank, _step = _SPEC.split(":")
    _write = dcp.FileSystemWriter.write_data

    def _mark(where: str) -> None:
        folder = os.environ.get("AUTOTITAN_FAULT_MARKER")
        if folder:
            os.makedirs(folder, exist_ok=True)
            name = f"rank-{os.environ['RANK']}-pid-{os.getpid()}"
            with open(os.path.join(folder, name), "w") as f:
                f.write(f"kill_in_save rank {os.environ['RANK']} pid {os.getpid()} writing {where}\n")

    def _killing_write(self, plan, planner):
        if f"step-{_step}.tmp" in str(self.path) and _rank in ("all", os.environ["RANK"]):
            _mark(str(self.path))
            os.kill(os.getpid(), signal.SIGKILL)
        return _write(self, plan, planner)

    dcp.FileSystemWriter.write_data = _killing_write
