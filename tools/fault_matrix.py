"""The fault matrix: a short job (8 steps, a checkpoint every 2) is hurt while it runs or
between runs, restarted as a user would (the same command), and must resume from the right
checkpoint and end with the uninterrupted run's weights.

    python scripts/fault_matrix.py [--modes manual,auto,auto_pp] [--worlds 2,4] [--trials-per-mode 20]
                                   [--faults all] [--timeout 300] [--seed 0]

Each (mode, world) runs `--trials-per-mode` trials, round-robin over the faults that apply
(each trial its own random step and rank). Faults (injected from outside the trainer: signals,
file damage, an environment hook, scripts/fault_hooks/sitecustomize.py):
  kill_step        kill -9 of one rank when rank 0 has printed a random step
  kill_save_all    kill -9 of every rank inside a checkpoint save (DCP writing its files; the hook)
  kill_save_one    kill -9 of one rank inside a save (the hook)
  kill_async_save  kill -9 of one rank inside an async save's background write ([checkpoint]
                   async_mode = "async"; the hook); compared with the blocking run
  kill_planning    kill -9 of one rank while the planner plans (auto mode only)
  kill_replan      kill -9 of one rank while it re-plans at a sequence-length change (auto only)
  sigterm          SIGTERM to every rank (a preemption): the step is finished, saved, exit 0
  sigterm_one      SIGTERM to one rank only: the ranks agree to stop, the same as sigterm
  hang_step        one rank never returns from a random optimizer step (the hook; its heartbeat
                   thread beats on): the others time out ([comm] timeout_s = 15) and one line
                   names it as behind them; the rerun resumes
  truncate_shard   the latest checkpoint's first shard cut in half (after the run ended)
  delete_shard     the latest checkpoint's first shard deleted
  flip_byte        one byte in the middle of the latest checkpoint's first shard flipped (same size)
  missing_manifest the latest checkpoint's manifest.json deleted
  bad_metadata     the latest checkpoint's .metadata overwritten with bytes that do not unpickle,
                   its manifest entry updated to match (the checksums pass: DCP's read fails)
  other_model      a restart with another model on the same folder: one config error, exit 2

A trial passes when: the fault fired (the script signalled a live worker, the hook left its
marker in $AUTOTITAN_FAULT_MARKER, or the file changed); the first run exited as the fault
implies (kill -9: non-zero; SIGTERM and file faults: 0, a SIGTERM stop at the folder's latest
checkpoint); the rerun exited 0, named the damaged checkpoint (file faults), resumed from the
step the folder says (the latest complete checkpoint whose files match its manifest, not the
damaged one), printed no step at or before it (its first step is the next one), and ended
with the uninterrupted run's losses and final state (a sha256 over every model and optimizer
tensor of step-8). other_model passes when it ends in its one config error, the checkpoint
untouched. Each torchrun runs in a session of its own under a deadline (`--timeout`, not
tied to its output); a run past it, and every run at its end, has its whole process tree
killed (each worker is found by a token in its environment).

Prints a line per trial, then one row per (mode, world, fault): trials, how many fired,
the steps resumed from (expected=got), how many ended identical (losses and digest), the
outcome with each failed trial's one line, the median seconds from the fault to the first
run's end and per trial; then a summary line. Exit 1 when any trial failed.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.fault_trials import (
    AUTO_ONLY,
    DAMAGES,
    FAULTS,
    HANGS,
    KILLS,
    OTHER_MODEL,
    SIGTERMS,
    STEPS,
    Facts,
    Reference,
    command,
    damage,
    expected_resume,
    got_resume,
    hook_markers,
    inject,
    losses,
    losses_diff,
    run,
    state_digest,
    verdict,
)


def schedule(faults: tuple[str, ...], mode: str, n: int) -> list[str]:
    """`n` trials, round-robin over the faults that apply to `mode` (planning faults: auto only;
    an auto pipeline plans its stages for one sequence length: no re-plan)."""
    apply = [f for f in faults if (mode != "manual" or f not in AUTO_ONLY) and not (
        mode == "auto_pp" and f == "kill_replan")]
    return [apply[i % len(apply)] for i in range(n)] if apply else []


def live_fault(facts: Facts, cmd: list[str], ckpts: Path, markers: Path, rng: random.Random,
               timeout: float) -> None:
    """A fault while the job runs (a signal or the hook), then the same command again."""
    trigger, fire, env = inject(facts.fault, facts.world, markers, rng)
    facts.first = run(cmd, env, timeout, trigger, fire)
    marked, at = hook_markers(markers)
    facts.fired = facts.first.fired + marked
    if at is not None:  # the hook's kill: the time from its marker to the run's end
        facts.first.fault_to_end_s = facts.first.ended - at
    facts.expected_resume = expected_resume(ckpts)
    if facts.fired and not facts.first.timed_out:
        facts.rerun = run(cmd, timeout=timeout)


def fault_between_runs(facts: Facts, cmd: list[str], ckpts: Path, timeout: float) -> None:
    """An uninterrupted run, then its folder damaged (or another model restarted on it)."""
    facts.first = run(cmd, timeout=timeout)
    if facts.first.rc != 0 or not expected_resume(ckpts):  # no intact checkpoint to hurt
        return
    if facts.fault == "other_model":
        facts.fired = [f"restarted with {' '.join(OTHER_MODEL)}"]
        facts.rerun = run(cmd + OTHER_MODEL, timeout=timeout)
        return
    facts.damaged, facts.damaged_file, changed = damage(ckpts, facts.fault)
    facts.fired = [f"{facts.fault}: {facts.damaged_file}"] if changed else []
    facts.expected_resume = expected_resume(ckpts, exclude=facts.damaged)
    facts.rerun = run(cmd, timeout=timeout)


def trial(mode: str, world: int, fault: str, base: Path, ref: Reference, rng: random.Random,
          timeout: float) -> Facts:
    """One fault and the rerun, in a folder of its own (deleted after); the facts recorded."""
    folder = Path(tempfile.mkdtemp(dir=base, prefix=f"{mode}-{world}-{fault}-"))
    ckpts = folder / "job" / "checkpoints"
    cmd = command(world, mode, fault, folder, "job")
    t0 = time.time()
    facts = Facts(mode, world, fault, first=None)
    try:
        if fault in KILLS or fault in SIGTERMS or fault in HANGS:
            live_fault(facts, cmd, ckpts, folder / "markers", rng, timeout)
        elif fault in DAMAGES or fault == "other_model":
            fault_between_runs(facts, cmd, ckpts, timeout)
        else:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        facts.losses_diff = losses_diff(losses(folder / "job"), ref.losses)
        try:
            facts.digest_equal = bool(ref.digest) and state_digest(ckpts / f"step-{STEPS}", folder) == ref.digest
        except Exception as e:  # noqa: BLE001 - a trial's missing or unreadable checkpoint is its failure
            have = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
            facts.digest_error = f"{type(e).__name__} (the checkpoint folder holds {have})"

    finally:
        shutil.rmtree(folder, ignore_errors=True)
    facts.seconds = time.time() - t0
    return facts


def reference(mode: str, world: int, fault: str, base: Path, timeout: float) -> Reference:
    """The uninterrupted run of `fault`'s job (its own folder, kept for the matrix's length)."""
    name = f"ref-{mode}-{world}-{int(fault == 'kill_replan')}"
    r = run(command(world, mode, "reference" if fault != "kill_replan" else fault, base, name), timeout=timeout)
    if r.rc != 0:
        raise RuntimeError(f"the uninterrupted run ({mode}, {world} ranks) failed (exit {r.rc}, timed out: "
                           f"{r.timed_out}): {r.out[-2000:]}")
    return Reference(losses(base / name), state_digest(base / name / "checkpoints" / f"step-{STEPS}", base))


@dataclass
class Row:
    mode: str
    world: int
    fault: str
    facts: list[Facts] = field(default_factory=list)


def header() -> str:
    return (f"{'mode':<7} {'world':>5} {'fault':<16} {'trials':>6} {'fired':>5} {'resumed (expected=got)':<24} "
            f"{'identical':>9} {'outcome':<10} {'fault->end s':>12} {'trial s':>8}")


def row_text(row: Row) -> str:
    fs = row.facts
    pairs = sorted({(f.expected_resume, got_resume(f)) for f in fs if got_resume(f) is not None})
    resumed = ",".join(f"{e}={g}" for e, g in pairs) or "-"
    failed = [(f, why) for f in fs if (why := verdict(f)) is not None]
    ident = sum(not f.losses_diff and f.digest_equal for f in fs)
    ends = [f.first.fault_to_end_s for f in fs if f.first is not None and f.first.fault_to_end_s is not None]
    end_s = f"{statistics.median(ends):.1f}" if ends else "-"
    outcome = "ok" if not failed else f"FAILED {len(failed)}"
    text = (f"{row.mode:<7} {row.world:>5} {row.fault:<16} {len(fs):>6} {sum(bool(f.fired) for f in fs):>5} "
            f"{resumed:<24} {ident:>9} {outcome:<10} {end_s:>12} {statistics.median(f.seconds for f in fs):>8.1f}")
    return text + "".join(f"\n    {why}" for _, why in failed)


def resumed_text(f: Facts) -> str:
    got = got_resume(f)
    return "no resume expected" if got is None else f"resumed from {got}, expected {f.expected_resume}"


def matrix(mode: str, world: int, faults: tuple[str, ...], n: int, base: Path, rng: random.Random,
           timeout: float) -> list[Row]:
    """`n` trials of one (mode, world), a line printed per trial; one row per fault."""
    refs: dict[bool, Reference] = {}
    rows: dict[str, Row] = {}
    for i, fault in enumerate(schedule(faults, mode, n), 1):
        key = fault == "kill_replan"
        if key not in refs:
            refs[key] = reference(mode, world, fault, base, timeout)
        facts = trial(mode, world, fault, base, refs[key], rng, timeout)
        rows.setdefault(fault, Row(mode, world, fault)).facts.append(facts)
        why = verdict(facts)
        print(f"  {mode} {world} #{i:<3} {fault:<16} {'ok' if why is None else 'FAILED: ' + why} "
              f"({resumed_text(facts)}; {facts.seconds:.1f} s)", flush=True)
    return [rows[f] for f in faults if f in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="manual,auto")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--trials-per-mode", type=int, default=20,
                    help="trials per mode and world, round-robin over the faults that apply")
    ap.add_argument("--faults", default="all", help=f"comma-separated, of: {', '.join(FAULTS)}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one torchrun may take before it is killed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    faults = FAULTS if args.faults == "all" else tuple(args.faults.split(","))
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown faults {unknown} (known: {', '.join(FAULTS)})")
    rng = random.Random(args.seed)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        for mode in args.modes.split(","):
            for world in map(int, args.worlds.split(",")):
                block = matrix(mode, world, faults, args.trials_per_mode, Path(tmp), rng, args.timeout)
                print("\n".join([header(), *map(row_text, block)]), flush=True)
                rows += block
    print("\n".join(["", header(), *map(row_text, rows)]))
    print(summary(rows))
    return 1 if any(verdict(f) is not None for r in rows for f in r.facts) else 0


def summary(rows: list[Row]) -> str:
    facts = [f for r in rows for f in r.facts]
    failed = sum(verdict(f) is not None for f in facts)
    per: dict[str, int] = {}
    for f in facts:
        per[f"{f.mode}/{f.world}"] = per.get(f"{f.mode}/{f.world}", 0) + 1
    counts = ", ".join(f"{k} {v}" for k, v in per.items())
    end = "every trial identical or ending in its named line" if not failed else f"{failed} failed"
    return f"fault matrix: {len(facts)} trials ({counts}), {sum(bool(f.fired) for f in facts)} fired; {end}"


if __name__ == "__main__":
    raise SystemExit(main())
