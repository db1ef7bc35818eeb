"""A long run: does anything grow? The debug model trains on 2 gloo ranks (torchrun) with an async
checkpoint every `--interval` steps, `keep_latest_k`, and validation; an observer outside the
trainer samples it while it runs.

    python scripts/soak.py [--steps 3000] [--report-every 500] [--interval 50] [--keep-latest-k 3]
                           [--validation-freq 200] [--local-batch-size 8] [--warm 500] [--clock wall]
                           [--timeout 14400]
                           [--keep]

Every `--report-every` steps one row: the step, each rank's RSS (VmRSS in /proc/PID/status of
torchrun's workers) and open file descriptors (/proc/PID/fd), the checkpoint folder's size on
disk and its number of step-* folders (complete, `.tmp` and `.deleting` alike), and the median
step time over the row's window (the time between consecutive `step N | loss` lines, as they
arrive here: checkpoint and validation steps included, the median ignores them), both ranks'
CPU time per step over the window (/proc/PID/stat: other jobs on the machine disturb it less
than wall time, but still: +-15 % between windows at a load of 8 on 2 cores) and the machine's
load average. The folder is also polled 4 times
a second for its peak size and count.

Verdicts (the thresholds of issue 51's long run), `--warm` steps being start-up:
  rss        growth from the row at step `--warm` to the last row, the larger of the two ranks: <= 5 %
  step time  the last window's median against the window ending at step 2 x `--warm` (or else the
             first window after `--warm`): slower by <= 5 % (faster passes). `--clock cpu` judges
             the CPU time per step instead (wall time on a machine shared with other jobs follows
             their load); the other clock is printed too. Judge step time on a quiet machine
  disk       never more than keep_latest_k + 1 step-* folders (k complete, one being written), and
             the folder's peak size <= (k + 1) x one complete checkpoint's size (+ 1 %: they differ
             by a few bytes)
Exit 0 when every verdict passes and the job ended with 0, 1 otherwise, 2 on bad arguments.
The run folder is a temporary folder, removed at the end unless `--keep` (then the job's
output is in soak.log there).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tools.bench_common import free_port
from tools.fault_trials import workers

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step (\d+) \| loss ")
LIMIT = 0.05
DISK_SLACK = 0.01  # checkpoints differ by a few bytes (the loader state, the manifest); a leaked one adds 1/(k+1)
MIB = 2**20


@dataclass
class Row:
    step: int
    rss_mib: list[float]  # per rank
    fds: list[int]  # per rank
    ckpt_mib: float
    ckpt_count: int
    step_ms: float  # median over the window ending at `step`
    cpu_ms: float = float("nan")  # both ranks' CPU time per step over the window
    load: float = float("nan")  # the machine's 1-minute load average


@dataclass
class Disk:
    peak_count: int = 0
    peak_mib: float = 0.0
    end_mib: float = 0.0
    one_mib: float = 0.0  # the largest complete checkpoint seen


@dataclass
class Verdict:
    name: str
    ok: bool
    text: str


def command(args: argparse.Namespace, folder: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), str(ROOT / "train.py"), "--config", "llama3_debug",
            "--training.steps", str(args.steps), "--training.local_batch_size", str(args.local_batch_size),
            "--metrics.log_freq", "1",
            "--checkpoint.enable", "true", "--checkpoint.interval", str(args.interval),
            "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", str(args.keep_latest_k),
            "--validation.enable", "true", "--validation.freq", str(args.validation_freq),
            "--job.dump_folder", str(folder), "--job.name", "soak"]


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        return kb / 1024
    except (OSError, StopIteration):
        return float("nan")  # the process has ended


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # deleted while we walk (a pruned checkpoint)
                pass
    return total


def step_folders(ckpt: Path) -> list[Path]:
    try:
        return [p for p in ckpt.iterdir() if p.name.startswith("step-")]
    except OSError:
        return []


def window_ms(times: dict[int, float], lo: int, hi: int) -> float:
    """Median ms between consecutive step lines for steps lo+1..hi (both lines seen)."""
    gaps = [times[s] - times[s - 1] for s in range(lo + 1, hi + 1) if s in times and s - 1 in times]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


class Poller:
    """The checkpoint folder's peak size and step-* count, sampled every `period` s in a thread."""

    def __init__(self, ckpt: Path, period: float = 0.25):
        self.ckpt, self.period, self.disk = ckpt, period, Disk()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, int]:
        """(MiB, step-* folders) now; updates the peaks and one complete checkpoint's size."""
        folders = step_folders(self.ckpt)
        sizes = {p.name: tree_bytes(p) / MIB for p in folders}
        complete = [v for k, v in sizes.items() if re.fullmatch(r"step-\d+", k)]
        d = self.disk
        d.peak_count = max(d.peak_count, len(folders))
        d.peak_mib = max(d.peak_mib, sum(sizes.values()))
        d.one_mib = max([d.one_mib, *complete])
        return sum(sizes.values()), len(folders)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.disk.end_mib = self.sample()[0]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class Observer:
    """Step lines in, rows out: the workers' /proc figures and the checkpoint folder at a row's step."""

    def __init__(self, launcher: int, poller: Poller):
        self.launcher, self.poller = launcher, poller
        self.pids: list[int] = []
        self.times: dict[int, float] = {}
        self.mark = (0, 0.0)  # (step, both ranks' CPU seconds) where the current window began

    def cpu(self) -> float:
        if not self.pids:
            ranks = workers(self.launcher)
            self.pids = [ranks[r] for r in sorted(ranks)]
        return sum(cpu_s(p) for p in self.pids)

    def step(self, step: int, now: float, report: bool) -> Row | None:
        self.times[step] = now
        if step == 1:
            self.mark = (1, self.cpu())  # CPU from step 1's line on: start-up left out
        if not report:
            return None
        begin, cpu0 = self.mark
        cpu = self.cpu()
        self.mark = (step, cpu)
        mib, count = self.poller.sample()
        return Row(step, [rss_mib(p) for p in self.pids], [open_fds(p) for p in self.pids], mib, count,
                   window_ms(self.times, begin, step), (cpu - cpu0) / max(step - begin, 1) * 1e3,
                   os.getloadavg()[0])


def watch(proc: subprocess.Popen, args: argparse.Namespace, poller: Poller, log: collections.deque) -> list[Row]:
    """Read the job's output to its end; a row at every `report_every`-th step line and the last."""
    obs = Observer(proc.pid, poller)
    rows: list[Row] = []
    for line in proc.stdout:
        now = time.monotonic()
        log.append(line)
        m = STEP_LINE.match(line)
        if m:
            step = int(m.group(1))
            row = obs.step(step, now, step % args.report_every == 0 or step == args.steps)
            if row is not None:
                rows.append(row)
                print(row_text(row), flush=True)
    return rows


def _pick(rows: list[Row], step: int) -> Row | None:
    return next((r for r in rows if r.step >= step), None)


def time_base(rows: list[Row], warm: int) -> Row:
    """The step-time baseline: the row at step 2 x warm (its window follows the warm-up), else the first after warm."""
    return next((r for r in rows if r.step == 2 * warm and r is not rows[-1]), None) or next(
        (r for r in rows if r.step > warm), None) or rows[0]


def step_time(rows: list[Row], warm: int, limit: float = LIMIT, clock: str = "wall") -> Verdict:
    """The last window's step time against the baseline window's, on the wall or CPU clock."""
    ms = (lambda r: r.step_ms) if clock == "wall" else (lambda r: r.cpu_ms)  # noqa: E731
    last, tbase = rows[-1], time_base(rows, warm)
    drift = ms(last) / ms(tbase) - 1
    return Verdict(f"step time ({clock})", drift <= limit, f"{drift:+.1%}: {ms(last):.1f} ms (window to step "
                   f"{last.step}) vs {ms(tbase):.1f} ms (window to step {tbase.step}); limit {limit:.0%}; load "
                   f"{tbase.load:.1f} then, {last.load:.1f} now")


def verdicts(rows: list[Row], disk: Disk, keep_latest_k: int, warm: int = 500,
             limit: float = LIMIT, clock: str = "wall") -> list[Verdict]:
    """The three verdicts of a run from its rows (see the module docstring); pure. `clock`: the
    step time judged, "wall" (the median step) or "cpu" (both ranks' CPU time per step)."""
    last = rows[-1]
    base = _pick(rows, warm) or rows[0]
    growth = max(b / a - 1 for a, b in zip(base.rss_mib, last.rss_mib))
    out = [Verdict("rss", growth <= limit, f"{growth:+.1%} from step {base.step} to {last.step} "
                   f"(max over ranks; limit {limit:.0%})")]
    out.append(step_time(rows, warm, limit, clock))
    cap = (keep_latest_k + 1) * disk.one_mib * (1 + DISK_SLACK)
    ok = disk.peak_count <= keep_latest_k + 1 and disk.one_mib > 0 and disk.peak_mib <= cap
    out.append(Verdict("disk", ok, f"peak {disk.peak_count} step-* folders (limit {keep_latest_k + 1}), peak "
                       f"{disk.peak_mib:.1f} MiB, end {disk.end_mib:.1f} MiB (limit (k+1) x {disk.one_mib:.1f} MiB "
                       f"+ 1 % = {cap:.1f} MiB)"))
    return out


def header() -> str:
    return (f"{'step':>6} {'rss0 MiB':>9} {'rss1 MiB':>9} {'fds0':>5} {'fds1':>5} {'ckpt MiB':>9} "
            f"{'ckpts':>5} {'step ms':>8} {'cpu ms':>7} {'load':>5}")


def row_text(r: Row) -> str:
    rss = [f"{v:>9.1f}" for v in (r.rss_mib + [float("nan")] * 2)[:2]]
    fds = [f"{v:>5}" for v in (r.fds + [-1] * 2)[:2]]
    return (f"{r.step:>6} {' '.join(rss)} {' '.join(fds)} {r.ckpt_mib:>9.1f} {r.ckpt_count:>5} {r.step_ms:>8.1f}"
            f" {r.cpu_ms:>7.1f} {r.load:>5.1f}")


def run(args: argparse.Namespace, folder: Path) -> int:
    """The job under an observer; the verdicts printed; the exit code."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log: collections.deque = collections.deque(maxlen=None if args.keep else 200)
    print(f"soak: {args.steps} steps, 2 gloo ranks, async checkpoint every {args.interval} (keep_latest_k "
          f"{args.keep_latest_k}), validation every {args.validation_freq}; run folder {folder}", flush=True)
    print(header(), flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(command(args, folder), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = threading.Event()
    timer = threading.Timer(args.timeout, lambda: (timed_out.set(), kill_job(proc.pid)))
    timer.start()
    try:
        with Poller(folder / "soak" / "checkpoints") as poller:
            rows = watch(proc, args, poller, log)
            rc = proc.wait()
    finally:
        timer.cancel()
        kill_job(proc.pid)  # nothing of the job outlives us
    if args.keep:
        (folder / "soak.log").write_text("".join(log))
    print(f"job: exit {rc} after {time.monotonic() - t0:.0f} s"
          + (f" (killed at --timeout {args.timeout:.0f} s)" if timed_out.is_set() else ""))
    if rc != 0 or not rows:
        print("".join(list(log)[-40:]), end="")
        return 1
    results = verdicts(rows, poller.disk, args.keep_latest_k, args.warm, clock=args.clock)
    other = step_time(rows, args.warm, clock="cpu" if args.clock == "wall" else "wall")
    for v in results:
        print(f"{v.name:<16} {'pass' if v.ok else 'FAIL'}  {v.text}")
    print(f"{other.name:<16} info  {other.text}")
    print(f"{'fds':<16} info  {rows[0].fds} at step {rows[0].step}, {rows[-1].fds} at step {rows[-1].step}")
    return 0 if all(v.ok for v in results) else 1


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or it has ended
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def kill_job(launcher: int) -> None:
    """SIGKILL to the launcher's process group and to its descendants' groups: torchrun starts
    every worker in a session of its own, which a kill of its group alone would leave running."""
    groups = {launcher}
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())
    for g in groups:
        with contextlib.suppress(OSError):
            os.killpg(g, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--report-every", type=int, default=500, help="steps between rows")
    ap.add_argument("--interval", type=int, default=50, help="[checkpoint] interval")
    ap.add_argument("--keep-latest-k", type=int, default=3, help="[checkpoint] keep_latest_k")
    ap.add_argument("--validation-freq", type=int, default=200, help="[validation] freq")
    ap.add_argument("--local-batch-size", type=int, default=8,
                    help="[training] local_batch_size (llama3_debug's is 8; smaller makes the long run cheaper)")
    ap.add_argument("--warm", type=int, default=500, help="steps of start-up before the baselines")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="the step time judged; cpu: both ranks' CPU time per step (a machine shared with other jobs)")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds; then the job's processes are killed")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (and the job's output, soak.log)")
    args = ap.parse_args(argv)
    for name in ("steps", "report_every", "interval", "keep_latest_k", "validation_freq", "timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warm < 0:
        ap.error("--warm must be >= 0")
    folder = Path(tempfile.mkdtemp(prefix="autotitan_soak_"))
    try:
        return run(args, folder)
    finally:
        if args.keep:
            print(f"run folder kept: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
