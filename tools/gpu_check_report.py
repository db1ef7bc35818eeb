"""The table of scripts/gpu_check.sh, read from its output folder; exit 1 when a run failed, a
profiled run left no trace, or a GPU run's losses differ from the CPU reference.

    python scripts/gpu_check_report.py --out outputs/gpu_check --runs outputs/gpu_check/runs [--tol 1e-3]

Reads OUT/status.tsv (name, exit code, seconds, timeout: written by the shell script), OUT/NAME.log
(the trainer's step lines `step N | loss L | ... | tok/s T | mfu M% | mem G GiB`, torch's
"Recompiling" and "Graph break" lines from TORCH_LOGS, the planner's "memory per device: ...; peak X
GiB" line), OUT/NAME.json.gz (a profiled run's trace) and RUNS/NAME/{losses.json,plan.json}.
tok/s and MFU are medians over the second half of the steps, the last one left out (the first steps
compile; a profiled run's last step is the profiled one); peak memory is the trainer's `mem` of that
last step kept (torch.cuda.max_memory_allocated since the start); the predicted peak is the plan's
estimate (plan.json "memory", else the log line).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

DEBUG = ("manual_eager", "manual_compiled", "auto_eager", "auto_compiled")  # checked against cpu_ref
B1 = ("1b_manual_compiled", "1b_auto_compiled")  # profiled on their last step
STEP = re.compile(r"^step (\d+) \| loss .*?\| tok/s (\d+) \| mfu ([\d.]+%|n/a) \| mem ([\d.]+) GiB", re.M)
PLAN_PEAK = re.compile(r"memory per device: .*?; peak ([\d,.]+) (GiB|MiB)")
MEASURED = re.compile(r"measured / predicted = ([\d.]+)")
ERROR = re.compile(r"^(config error:|(\[rank\d+\]: )?[\w.]*(Error|Exception)\b)")
TIMEOUT_RC = {124, 137}


def status(out: Path) -> dict[str, tuple[int, int]]:
    """name -> (exit code, seconds) from status.tsv."""
    rows = {}
    p = out / "status.tsv"
    for line in p.read_text().splitlines() if p.exists() else []:
        name, rc, secs, _limit = line.split("\t")
        rows[name] = (int(rc), int(secs))
    return rows


def losses(runs: Path, name: str) -> dict[int, float]:
    p = runs / name / "losses.json"
    try:
        return {int(k): v for k, v in json.loads(p.read_text())["loss"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def predicted_peak_gib(runs: Path, name: str, log: str) -> float | None:
    """The plan's predicted peak per device (auto runs), in GiB."""
    try:
        mem = json.loads((runs / name / "plan.json").read_text()).get("memory") or {}
        if "peak_bytes" in mem:
            return mem["peak_bytes"] / 2**30
    except (OSError, ValueError):
        pass
    m = PLAN_PEAK.findall(log)
    if m:
        value, unit = m[-1]
        return float(value.replace(",", "")) / (1024 if unit == "MiB" else 1)
    return None


def step_figures(log: str) -> tuple[float | None, float | None, float | None, int]:
    """(median tok/s, median MFU %, peak memory GiB, steps logged): see the module's docstring."""
    rows = {int(s): (float(t), None if m == "n/a" else float(m.rstrip("%")), float(g))
            for s, t, m, g in STEP.findall(log)}
    if not rows:
        return None, None, None, 0
    steps = sorted(rows)
    kept = steps[:-1] if len(steps) >= 4 else steps
    late = [rows[s] for s in kept[len(kept) // 2:]]
    mfus = [r[1] for r in late if r[1] is not None]
    return (statistics.median(r[0] for r in late), statistics.median(mfus) if mfus else None,
            rows[kept[-1]][2], len(steps))


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def error_line(log: str) -> str:
    """The first error a run printed (the worker's, not torchrun's summary), else its last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ERROR.match(ln) and "ChildFailedError" not in ln]
    return (errors or lines[-1:] or [""])[0][:200]


def max_rel_diff(got: dict[int, float], ref: dict[int, float]) -> tuple[float | None, int]:
    common = sorted(set(got) & set(ref))
    if not common:
        return None, 0
    return max(abs(got[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in common), len(common)


NOT_ASKED = 126  # gpu_check.sh's status for a variant that ONLY= left out


def run_state(rc: int | None, n_steps: int) -> str:
    if rc is None:
        return "FAILED not run"
    if rc == 125:
        return "FAILED skipped"  # the script's budget ran out before it
    if rc in TIMEOUT_RC:
        return "FAILED timeout"
    if rc != 0:
        return f"FAILED rc {rc}"
    return "ok" if n_steps else "FAILED no steps"  # it ran, but no step line was parsed


def _verdict(args: argparse.Namespace, name: str, ref: list, failed: list[str]) -> str:
    """The losses column: a debug variant against the CPU run, the 1B auto run against manual."""
    if name in DEBUG:
        diff, n = max_rel_diff(losses(args.runs, name), ref)
        if diff is None:
            failed.append(f"{name}: no losses to compare")
            return "FAILED (no losses)" if ref else "FAILED (no CPU losses)"
        ok = diff <= args.tol and n == len(ref)
        if not ok:
            failed.append(f"{name}: losses differ from the CPU run")
        return f"{'match' if ok else 'DIFFER'} vs CPU {diff:.1e} ({n})"
    if name == "1b_auto_compiled":  # bf16, two different programs: shown, not judged
        diff, n = max_rel_diff(losses(args.runs, name), losses(args.runs, "1b_manual_compiled"))
        return f"vs manual {diff:.1e} ({n})" if diff is not None else "-"
    return "-"


def _row(args: argparse.Namespace, name: str, st: dict, ref: list, profiles: list[str], failed: list[str],
         notes: list[str], tps: dict[str, float | None]) -> str:
    """One variant's table line (its failures and notes appended to `failed`, `notes`)."""
    rc, secs = st.get(name, (None, 0))
    if rc == NOT_ASKED:  # ONLY= named other variants: this one is neither run nor judged
        tps[name] = None
        return f"{name:<22} {'not run (ONLY)':<15}"
    logp = args.out / f"{name}.log"
    log = logp.read_text(errors="replace") if logp.exists() else ""
    t, mfu, mem, n_steps = step_figures(log)
    state = run_state(rc, n_steps)
    if state != "ok":
        failed.append(f"{name}: {state[7:]}")
        notes.append(f"{name}: {error_line(log) if log else 'no log'}")
    verdict = _verdict(args, name, ref, failed)
    trace = "-"
    if name in B1 or name in profiles:
        trace = "yes" if (args.out / f"{name}.json.gz").exists() else "NO"
        if trace == "NO" and state == "ok":
            failed.append(f"{name}: no profiler trace")
    if name in profiles:  # 4 steps, the last one profiled: no speed worth showing
        t = mfu = None
    tps[name] = t if state == "ok" else None
    pred = predicted_peak_gib(args.runs, name, log) if "auto" in name else None
    compiled = "compiled" in name or name in profiles
    recomp = sum("Recompiling" in ln for ln in log.splitlines()) if compiled else "-"
    breaks = sum("Graph break" in ln for ln in log.splitlines()) if compiled else "-"
    m = MEASURED.findall(log)
    if m:
        notes.append(f"{name}: step time measured / predicted by the cost model = {m[-1]}")
    return (f"{name:<22} {state:<15} {secs:>4}s {fmt(t, ',.0f'):>9} {fmt(mfu, '.1f', '%'):>6} "
            f"{fmt(mem, '.2f'):>8} {fmt(pred, '.2f'):>8}  {verdict:<28} {recomp:>6} {breaks:>6} {trace:>5}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args(argv)
    st = status(args.out)
    ref = losses(args.runs, "cpu_ref")
    failed: list[str] = []
    tps: dict[str, float | None] = {}
    notes: list[str] = []
    header = (f"{'variant':<22} {'status':<15} {'time':>5} {'tok/s':>9} {'MFU':>6} {'peak GiB':>8} {'pred GiB':>8}  "
              f"{'losses (max rel diff)':<28} {'recomp':>6} {'breaks':>6} {'trace':>5}")
    lines = [header, "-" * len(header)]
    profiles = sorted(n for n in st if n.startswith("profile_"))  # PROFILE_DEBUG=1
    for name in ["cpu_ref", *DEBUG, *B1, *profiles]:
        lines.append(_row(args, name, st, ref, profiles, failed, notes, tps))
    print()
    versions = args.out / "versions.txt"
    if versions.exists():
        print(versions.read_text().strip())
    print("\n".join(lines))
    ratio = lambda a, b: f"{tps[a] / tps[b]:.2f}" if tps.get(a) and tps.get(b) else "n/a"  # noqa: E731
    print(f"auto/manual compiled tok/s: debug {ratio('auto_compiled', 'manual_compiled')}, "
          f"1B {ratio('1b_auto_compiled', '1b_manual_compiled')}")
    print("tok/s, MFU: medians over the second half of the steps, the last (profiled in 1b runs) left out; peak GiB: "
          "torch.cuda.max_memory_allocated (CPU: resident memory); pred GiB: the plan's estimate (for eager "
          "execution: Inductor plans its own buffers)")
    for n in notes:
        print("  " + n)
    if failed:
        print("gpu_check: FAILED: " + "; ".join(failed))
        return 1
    print(f"gpu_check: all runs ok, GPU losses within {args.tol:g} of the CPU run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
