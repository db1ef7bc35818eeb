"""The fault matrix: a short job is hurt from outside while it runs, restarted as a user would
(the same command), and must finish with the losses of an uninterrupted run.

    python scripts/fault_matrix.py [--modes manual,auto] [--worlds 2,4] [--kill-points 20] [--faults all]

Faults (injected from outside the trainer: signals, file damage, an environment hook the
script sets, scripts/fault_hooks/sitecustomize.py):
  kill_step       kill -9 of one rank at a random step
  kill_save_all   kill -9 of every rank inside the checkpoint save (DCP writing its files)
  kill_save_one   kill -9 of one rank inside the save
  kill_async_save kill -9 of one rank inside an async save ([checkpoint] async_mode = "async": DCP's
                  background write, the next steps running); compared with the blocking run's losses
  kill_planning   kill -9 of one rank while the planner plans (auto mode)
  kill_replan     kill -9 of one rank while it re-plans at a sequence-length change (auto mode)
  sigterm         SIGTERM to every rank (a preemption): the step is finished, saved, exit 0
  truncate_shard  the latest checkpoint's first shard cut in half (after the run stopped)
  delete_shard    the latest checkpoint's first shard deleted
  other_model     a restart with another model on the same folder: one config error, exit 2

Prints one row per (mode, world, fault): trials, the steps resumed from, whether every
trial's losses equal the uninterrupted run's (bit for bit), and the time from the fault to
the job's end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "scripts" / "fault_hooks"
STEPS, INTERVAL = 8, 2
JOB = ["--config", "llama3_debug", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size",
       "2", "--metrics.log_freq", "1", "--training.steps", str(STEPS), "--checkpoint.enable", "true",
       "--checkpoint.interval", str(INTERVAL)]
AUTO = ["--parallelism.mode", "auto", "--parallelism.hardware", "cpu", "--parallelism.memory_estimate", "false"]
REPLAN = ["--training.seq_len_schedule", "[[0, 16], [4, 32]]"]
ASYNC = ["--checkpoint.async_mode", "async"]
FAULTS = ("kill_step", "kill_save_all", "kill_save_one", "kill_async_save", "kill_planning", "kill_replan", "sigterm",
          "truncate_shard", "delete_shard", "other_model")
AUTO_ONLY = ("kill_planning", "kill_replan")
PLANNING_LINE = "trace"  # the planner's first progress line (rank 0): the job is planning


@dataclass
class Outcome:
    resumed: list[int] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def command(world: int, mode: str, fault: str, folder: Path, name: str) -> list[str]:
    extra = (AUTO if mode == "auto" else []) + (REPLAN if fault == "kill_replan" else []) + (
        ASYNC if fault == "kill_async_save" else [])
    return ["torchrun", "--nproc_per_node", str(world), "--master_port", str(random.randint(20000, 40000)),
            str(ROOT / "train.py"), *JOB, *extra, "--job.dump_folder", str(folder), "--job.name", name]


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (their RANK environment variable)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            out.update({int(e[5:]): int(pid) for e in f.read().split(b"\0") if e.startswith(b"RANK=")})
    return out


def run(cmd: list[str], trigger=None, fire=None, env: dict | None = None, timeout: float = 600) -> tuple:
    """Run `cmd`; when `trigger(line)` is true, `fire(launcher_pid)`. (exit code, output, seconds
    from the fault to the end)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, fired_at = [], None
    deadline = time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if fired_at is None and trigger is not None and trigger(line):
            fire(proc.pid)
            fired_at = time.time()
        if time.time() > deadline:
            proc.kill()
    proc.wait()
    return proc.returncode, "".join(lines), (time.time() - fired_at) if fired_at else 0.0


def losses(folder: Path, name: str) -> dict[str, float]:
    try:
        return json.loads((folder / name / "losses.json").read_text())["loss"]
    except (OSError, ValueError, KeyError):
        return {}


def resumed_step(out: str) -> int:
    for line in out.splitlines():
        if line.startswith("resumed from ") and " at step " in line:
            return int(line.rsplit(" at step ", 1)[1])
    return 0


def inject(fault: str, world: int) -> tuple:
    """(trigger, fire, env) of a fault that strikes while the job runs."""
    victim = random.randrange(world)
    kill_one = lambda pid: os.kill(workers(pid)[victim], signal.SIGKILL)  # noqa: E731
    if fault == "kill_step":
        at = random.randint(2, STEPS - 1)
        return (lambda ln: ln.startswith(f"step {at} |")), kill_one, {}
    if fault in ("kill_save_all", "kill_save_one", "kill_async_save"):
        step = random.choice(range(INTERVAL * 2, STEPS, INTERVAL))
        rank = "all" if fault == "kill_save_all" else str(victim)
        return None, None, {"AUTOTITAN_FAULT": f"kill_in_save:{rank}:{step}", "PYTHONPATH": str(HOOKS)}
    if fault == "kill_planning":
        return (lambda ln: ln.startswith(PLANNING_LINE)), kill_one, {}
    if fault == "kill_replan":
        return (lambda ln: "sequence length" in ln or ln.startswith("step 4 |")), kill_one, {}
    if fault == "sigterm":
        at = random.randint(2, STEPS - 1)

        def term_all(pid: int) -> None:
            for p in workers(pid).values():
                os.kill(p, signal.SIGTERM)
        return (lambda ln: ln.startswith(f"step {at} |")), term_all, {}
    raise ValueError(fault)


def damage_latest(folder: Path, name: str, fault: str) -> str:
    ckpts = sorted((folder / name / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    shard = sorted(ckpts[-1].glob("*.distcp"))[0]
    if fault == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    return str(shard)


def trial(mode: str, world: int, fault: str, base: Path, ref: dict[str, float], outcome: Outcome) -> None:
    """One fault, then the same command again; the losses compared with the reference run's."""
    folder = Path(tempfile.mkdtemp(dir=base))
    cmd = command(world, mode, fault, folder, "job")
    if fault in ("truncate_shard", "delete_shard", "other_model"):
        rc, out, _ = run(cmd)
        assert rc == 0, out[-2000:]
        if fault == "other_model":
            rc, out, _ = run(cmd + ["--model.dim", "128", "--model.n_heads", "4"])
            # a config error: exit 2 on every rank (torchrun reports the ranks' codes and exits 1)
            ok = (rc == 2 or "exitcode  : 2" in out) and "config error: checkpoint" in out and "another model" in out
            outcome.identical.append(ok)
            outcome.notes.append("" if ok else out[-300:])
            return
        damaged = damage_latest(folder, "job", fault)
        t0 = time.time()
        rc, out, _ = run(cmd)
        named = "skipping damaged checkpoint" in out and damaged in out
        outcome.detect_s.append(time.time() - t0)
    else:
        trigger, fire, env = inject(fault, world)
        rc, out, detect = run(cmd, trigger, fire, env)
        if trigger is not None:  # a fault the script fired: the time until the job ended
            outcome.detect_s.append(detect)
        if fault == "sigterm" and rc != 0:
            outcome.notes.append(f"SIGTERM: exit {rc}")
        named = True
        rc, out, _ = run(cmd)  # the user runs the same command again
    outcome.resumed.append(resumed_step(out))
    got = losses(folder, "job")
    same = rc == 0 and got == ref and named
    outcome.identical.append(same)
    if not same:
        diff = next((f"step {s}: {got.get(s)} vs {v} uninterrupted" for s, v in ref.items() if got.get(s) != v), "")
        outcome.notes.append(f"exit {rc}, {len(got)} losses, damage named: {named}; first difference: {diff}; "
                             f"{out[-300:]}")
    shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="manual,auto")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--kill-points", type=int, default=20,
                    help="kill -9 trials per mode and world, spread over the kill faults that apply to the mode")
    ap.add_argument("--trials", type=int, default=None, help="instead: trials of each random-point fault")
    ap.add_argument("--faults", default="all", help=f"comma-separated, of: {', '.join(FAULTS)}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    random.seed(args.seed)
    faults = FAULTS if args.faults == "all" else tuple(args.faults.split(","))
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for mode in args.modes.split(","):
            for world in map(int, args.worlds.split(",")):
                refs = {}
                for fault in faults:
                    if fault in AUTO_ONLY and mode != "auto":
                        continue
                    key = fault == "kill_replan"
                    if key not in refs:  # the uninterrupted run of this job, in a folder of its own
                        name = f"ref-{mode}-{world}-{int(key)}"
                        rc, out, _ = run(command(world, mode, fault, base, name))
                        assert rc == 0, out[-3000:]
                        refs[key] = losses(base, name)
                    outcome = Outcome()
                    n = trials(args, fault, mode, faults)
                    for _ in range(n):
                        trial(mode, world, fault, base, refs[key], outcome)
                    failed += not all(outcome.identical)
                    rows.append((mode, world, fault, outcome))
                    print(row_text(rows[-1]), flush=True)
    print("\n".join(["", header(), *map(row_text, rows)]))
    print(f"fault matrix: {'every trial identical' if not failed else f'{failed} rows with a failed trial'}")
    return 1 if failed else 0


def trials(args: argparse.Namespace, fault: str, mode: str, faults: tuple) -> int:
    """Trials of `fault`: one for the file faults; the kill points split over the kill faults."""
    if not (fault.startswith("kill") or fault == "sigterm"):
        return 1
    if args.trials is not None:
        return args.trials
    if fault == "sigterm":
        return 2
    kills = [f for f in faults if f.startswith("kill") and (mode == "auto" or f not in AUTO_ONLY)]
    return -(-args.kill_points // len(kills))


def header() -> str:
    return (f"{'mode':<7} {'world':>5} {'fault':<15} {'trials':>6} {'resumed from':<18} {'identical':<10} "
            f"{'detect s':>9}")


def row_text(row: tuple) -> str:
    mode, world, fault, o = row
    steps = ",".join(map(str, sorted(set(o.resumed)))) or "-"
    det = f"{statistics.median(o.detect_s):.1f}" if o.detect_s else "-"
    ident = "yes" if all(o.identical) else f"NO ({o.identical.count(False)})"
    text = f"{mode:<7} {world:>5} {fault:<15} {len(o.identical):>6} {steps:<18} {ident:<10} {det:>9}"
    return text + "".join(f"\n    {n}" for n in o.notes if n)


if __name__ == "__main__":
    raise SystemExit(main())
