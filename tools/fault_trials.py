"""The pieces of one fault-matrix trial (tools/fault_matrix.py): the job's command, running
torchrun under a deadline with its whole process tree killed at the end, the faults (signals
to workers, the injection hook's environment, file damage), what the checkpoint folder says
the resume step must be, the final state's digest, and the verdict on what was recorded.

Everything here is independent of the trainer's code: the folder is read with `xxhash`
against its ``manifest.json`` and the final state with DCP's public ``dcp_to_torch_save``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import xxhash

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "scripts" / "fault_hooks"
STEPS, INTERVAL = 8, 2
JOB = ["--config", "llama3_debug", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size",
       "2", "--metrics.log_freq", "1", "--training.steps", str(STEPS), "--checkpoint.enable", "true",
       "--checkpoint.interval", str(INTERVAL)]
AUTO = ["--parallelism.mode", "auto", "--parallelism.hardware", "cpu", "--parallelism.memory_estimate", "false"]
PIPELINE = ["--parallelism.pipeline_parallel_degree", "2"]  # mode "auto_pp": auto mode's planned stages
REPLAN = ["--training.seq_len_schedule", "[[0, 16], [4, 32]]"]
ASYNC = ["--checkpoint.async_mode", "async"]
OTHER_MODEL = ["--model.dim", "128", "--model.n_heads", "4"]
KILLS = ("kill_step", "kill_save_all", "kill_save_one", "kill_async_save", "kill_planning", "kill_replan")
SIGTERMS = ("sigterm", "sigterm_one")
HANGS = ("hang_step",)  # a rank that never returns from a call while its heartbeat thread beats
HANG = ["--comm.timeout_s", "15"]  # how long the others wait for it
DAMAGES = ("truncate_shard", "delete_shard", "flip_byte", "missing_manifest", "bad_metadata")
FAULTS = (*KILLS, *SIGTERMS, *HANGS, *DAMAGES, "other_model")
AUTO_ONLY = ("kill_planning", "kill_replan")
HOOKED = ("kill_save_all", "kill_save_one", "kill_async_save", "hang_step")  # by scripts/fault_hooks/sitecustomize.py
RUN_TOKEN = "AUTOTITAN_FAULT_RUN"  # every process of one torchrun carries it: the tree can be found and killed
MARKER_ENV = "AUTOTITAN_FAULT_MARKER"  # the folder the injection hook marks before it kills
STEP_RE = re.compile(r"^step (\d+) \| loss ")
RESUMED_RE = re.compile(r"resumed from (.+) at step (\d+)$")
STOPPED_RE = re.compile(r"stopped after step (\d+) on SIGTERM")
CKPT_RE = re.compile(r"^step-(\d+)$")
GARBAGE = b"\xffnot DCP metadata\n" * 64  # 0xff is no pickle opcode: unpickling fails at once


def command(world: int, mode: str, fault: str, folder: Path, name: str) -> list[str]:
    """The job's torchrun command (`--standalone`: torchrun picks a free port itself)."""
    extra = (AUTO if mode in ("auto", "auto_pp") else []) + (PIPELINE if mode == "auto_pp" else []) + (
        REPLAN if fault == "kill_replan" else []) + (
        ASYNC if fault == "kill_async_save" else []) + (HANG if fault in HANGS else [])
    return ["torchrun", "--standalone", "--nproc_per_node", str(world), str(ROOT / "train.py"), *JOB, *extra,
            "--job.dump_folder", str(folder), "--job.name", name]


# ---------------------------------------------------------------------------------- processes


@dataclass
class Run:
    """One torchrun: exit code (None: timed out), output, what the fault did (empty: it never
    fired), seconds from the fault to the end, the run's seconds."""

    rc: Optional[int]
    out: str
    fired: list[str] = field(default_factory=list)
    fault_to_end_s: Optional[float] = None
    seconds: float = 0.0
    timed_out: bool = False
    timeout_s: float = 0.0
    ended: float = 0.0  # time.time() at its end


def tagged(token: str) -> list[int]:
    """Pids of the live processes whose environment carries ``AUTOTITAN_FAULT_RUN=token``."""
    want = f"{RUN_TOKEN}={token}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if want in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
    return out


def kill_tree(launcher: int, token: str) -> None:
    """SIGKILL torchrun's process group and every process of the run (torchrun starts each
    worker in a session of its own: the group alone misses them; the token finds them, orphans too)."""
    with contextlib.suppress(OSError):
        os.killpg(launcher, signal.SIGKILL)
    for _ in range(5):
        pids = [p for p in tagged(token) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # a worker leads its group: its own children too
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of torchrun's live workers (its children with a RANK environment variable)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (d / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == launcher and state not in ("Z", "X"):
                env = (d / "environ").read_bytes().split(b"\0")
                out.update({int(e[5:]): int(d.name) for e in env if e.startswith(b"RANK=")})
    return out


def _read(proc: subprocess.Popen, lines: list[str], trigger: Optional[Callable[[str], bool]],
          fire: Optional[Callable[[int], list[str]]], record: Run, fired_at: list[float]) -> None:
    """The reader thread: collects lines; the first line that `trigger` accepts fires the fault."""
    for line in proc.stdout:
        lines.append(line)
        if trigger is not None and not fired_at and trigger(line.rstrip("\n")):
            fired_at.append(time.time())
            try:
                record.fired = fire(proc.pid)
            except Exception as e:  # noqa: BLE001 - not fired (recorded); keep reading, or the pipe fills
                lines.append(f"fault_matrix: the fault could not be fired: {type(e).__name__}: {e}\n")


def run(cmd: list[str], env: Optional[dict] = None, timeout: float = 300.0,
        trigger: Optional[Callable[[str], bool]] = None, fire: Optional[Callable[[int], list[str]]] = None) -> Run:
    """Run `cmd` in a session of its own under a deadline that does not depend on its output;
    when a line matches `trigger`, `fire(torchrun's pid)` (it returns what it did). At the end
    (exit, time-out or an error here) the whole process tree is killed: no rank survives."""
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {}), RUN_TOKEN: token}
    record, lines, fired_at = Run(None, ""), [], []
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    reader = threading.Thread(target=_read, args=(proc, lines, trigger, fire, record, fired_at), daemon=True)
    reader.start()
    try:
        record.rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        record.timed_out, record.timeout_s = True, timeout
    finally:
        kill_tree(proc.pid, token)
        proc.wait()
        reader.join(timeout=10)
    record.ended = time.time()
    record.seconds = record.ended - t0
    record.out = "".join(lines)
    if fired_at:
        record.fault_to_end_s = record.ended - fired_at[0]
    return record


def signal_workers(ranks: Callable[[dict[int, int]], list[int]], sig: int) -> Callable[[int], list[str]]:
    """A `fire`: send `sig` to the live workers that `ranks(rank -> pid)` picks; what was sent."""
    def fire(launcher: int) -> list[str]:
        sent = []
        found = workers(launcher)
        for rank in [r for r in ranks(found) if r in found]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(found[rank], sig)
                sent.append(f"{signal.Signals(sig).name} rank {rank} pid {found[rank]}")
        return sent
    return fire


# ---------------------------------------------------------------------------------- faults


def inject(fault: str, world: int, markers: Path, rng: random.Random) -> tuple:
    """(trigger, fire, env) of a fault that strikes while the job runs, at a random point."""
    victim = rng.randrange(world)
    one = signal_workers(lambda found: [victim] if victim in found else [], signal.SIGKILL)
    if fault == "kill_step":
        at = rng.randint(2, STEPS - 1)
        return (lambda ln: ln.startswith(f"step {at} |")), one, {}
    if fault in HOOKED:
        step = rng.choice(range(INTERVAL, STEPS + 1, INTERVAL))
        rank = "all" if fault == "kill_save_all" else str(victim)
        spec = f"hang_in_step:{victim}:{rng.randint(2, STEPS - 1)}" if fault in HANGS else \
            f"kill_in_save:{rank}:{step}"
        path = os.pathsep.join([str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])])
        return None, None, {"AUTOTITAN_FAULT": spec, "PYTHONPATH": path, MARKER_ENV: str(markers)}
    if fault == "kill_planning":  # the planner's first progress line (rank 0): the job is planning
        return (lambda ln: ln.startswith("trace")), one, {}
    if fault == "kill_replan":  # the re-plan's first progress line, once step 4 (the last at length 16) is done
        seen = []
        return (lambda ln: bool(seen.append(1) if ln.startswith("step 4 |") else seen and ln.startswith("trace"))), \
            one, {}
    if fault in SIGTERMS:
        at = rng.randint(1, STEPS - 2)  # the stop lands before the last step: the rerun has steps left
        pick = (lambda found: sorted(found)) if fault == "sigterm" else (
            lambda found: [victim] if victim in found else [])
        return (lambda ln: ln.startswith(f"step {at} |")), signal_workers(pick, signal.SIGTERM), {}
    raise ValueError(fault)


def hook_markers(markers: Path) -> tuple[list[str], Optional[float]]:
    """What the injection hook left before it killed (one file per killed process), and when
    the first was written (None: never)."""
    files = sorted(markers.glob("*")) if markers.is_dir() else []
    return [p.read_text().strip() for p in files], min((p.stat().st_mtime for p in files), default=None)


def damage(ckpts: Path, fault: str) -> tuple[Path, Path, bool]:
    """Damage the latest intact checkpoint after the run: (the checkpoint, the file hurt,
    whether the file really changed)."""
    latest = ckpts / f"step-{expected_resume(ckpts)}"
    if fault == "missing_manifest":
        target = latest / "manifest.json"
        target.unlink()
        return latest, target, not target.exists()
    if fault == "bad_metadata":
        return latest, latest / ".metadata", _bad_metadata(latest)
    target = sorted(latest.glob("*.distcp"))[0]
    before = target.read_bytes()
    if fault == "truncate_shard":
        target.write_bytes(before[: len(before) // 2])
    elif fault == "delete_shard":
        target.unlink()
    elif fault == "flip_byte":
        mid = len(before) // 2
        target.write_bytes(before[:mid] + bytes([before[mid] ^ 0xFF]) + before[mid + 1:])
    else:
        raise ValueError(fault)
    changed = not target.exists() or (target.read_bytes() != before and (
        fault != "flip_byte" or target.stat().st_size == len(before)))
    return latest, target, changed


def _bad_metadata(ckpt: Path) -> bool:
    """Overwrite ``.metadata`` with bytes that do not unpickle and update its manifest entry to
    match: the checksums pass, DCP's read of the folder fails. Whether the file changed."""
    meta = ckpt / ".metadata"
    before = meta.read_bytes()
    meta.write_bytes(GARBAGE)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(GARBAGE), "xxh3_64": xxhash.xxh3_64(GARBAGE).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return meta.read_bytes() != before


# ---------------------------------------------------------------------------------- the folder


def checkpoint_dirs(ckpts: Path) -> dict[int, Path]:
    """{step: folder} of the ``step-N`` folders (any state)."""
    found = {int(m.group(1)): p for p in (ckpts.iterdir() if ckpts.is_dir() else []) if (m := CKPT_RE.match(p.name))}
    return dict(sorted(found.items()))


def intact(ckpt: Path) -> bool:
    """A complete checkpoint: ``.metadata`` and a manifest whose every file is there with its
    size and xxh3-64 checksum."""
    try:
        files = json.loads((ckpt / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not (ckpt / ".metadata").is_file() or ".metadata" not in files:
        return False
    for name, want in files.items():
        f = ckpt / name
        size, check = (want, None) if isinstance(want, int) else (want.get("bytes"), want.get("xxh3_64"))
        if not f.is_file() or f.stat().st_size != size:
            return False
        if check is not None and xxhash.xxh3_64(f.read_bytes()).hexdigest() != check:
            return False
    return True


def expected_resume(ckpts: Path, exclude: Optional[Path] = None) -> int:
    """The step a restart must resume from: the latest intact checkpoint other than `exclude`
    (a damaged one whose damage passes the checksums); 0 when there is none."""
    steps = [s for s, p in checkpoint_dirs(ckpts).items() if p != exclude and intact(p)]
    return max(steps, default=0)


def step_lines(out: str) -> list[int]:
    """The training steps a run printed ("step K | loss ..."), in order."""
    return [int(m.group(1)) for ln in out.splitlines() if (m := STEP_RE.match(ln.strip()))]


def resumed(out: str) -> list[tuple[str, int]]:
    """(path, step) of each "resumed from PATH at step N" line."""
    return [(m.group(1), int(m.group(2))) for ln in out.splitlines() if (m := RESUMED_RE.search(ln.strip()))]


def losses(run_dir: Path) -> dict[str, float]:
    try:
        return json.loads((run_dir / "losses.json").read_text())["loss"]
    except (OSError, ValueError, KeyError):
        return {}


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _leaves(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{prefix}{i}.")]
    return [(prefix[:-1], obj)]


def state_digest(ckpt: Path, scratch: Path) -> str:
    """sha256 over the model's and optimizer's state in a DCP checkpoint: every leaf by sorted
    key; a tensor's dtype, shape and raw bytes, anything else its repr. '' when unreadable."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"digest-{uuid.uuid4().hex}.pt"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(ckpt, out)
        state = torch.load(out, weights_only=True)
    except Exception:  # noqa: BLE001 - a missing or unreadable checkpoint: no digest
        return ""
    finally:
        out.unlink(missing_ok=True)
    h = hashlib.sha256()
    for key, value in sorted(_leaves({k: state[k] for k in ("model", "optimizer") if k in state})):
        h.update(key.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype} {tuple(value.shape)}\0".encode() + t.view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------- a trial


@dataclass
class Reference:
    """The uninterrupted run of a job: its losses and its final state's digest."""

    losses: dict[str, float]
    digest: str


@dataclass
class Facts:
    """What one trial recorded (judged by `verdict`)."""

    mode: str
    world: int
    fault: str
    first: Run
    rerun: Optional[Run] = None
    fired: list[str] = field(default_factory=list)
    expected_resume: int = 0
    damaged: Optional[Path] = None  # the checkpoint a file fault hurt
    damaged_file: Optional[Path] = None
    losses_diff: str = ""  # '' when the losses equal the uninterrupted run's
    digest_equal: bool = False
    digest_error: str = ""  # why the final checkpoint could not be read ('' when it was)
    seconds: float = 0.0


def losses_diff(got: dict[str, float], ref: dict[str, float]) -> str:
    """The first step whose loss differs from the uninterrupted run's ('' when none)."""
    for step in sorted(set(ref) | set(got), key=int):
        if got.get(step) != ref.get(step):
            return f"step {step}: {got.get(step)} vs {ref.get(step)} uninterrupted"
    return ""


def _tail(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def first_run_problem(f: Facts) -> Optional[str]:
    """What is wrong with the first run: a time-out, a fault that did not fire, the wrong exit
    code (kill -9: non-zero; SIGTERM to all or one rank, file faults: 0), a SIGTERM stop that
    names another step than the folder's latest checkpoint."""
    first = f.first
    if first.timed_out:
        return f"the first run timed out after {first.timeout_s:.0f} s"
    if f.fault in KILLS or f.fault in HANGS:
        if not f.fired:
            return "fault did not fire"
        if first.rc == 0:
            return "the first run exited 0 although a rank was killed or hung"
        if f.fault in HANGS:
            return hang_problem(f)
    else:
        if first.rc != 0:
            return f"the first run exited {first.rc}, not 0: {_tail(first.out)}"
        if not f.fired:
            return "fault did not fire"
    if f.fault in SIGTERMS:
        stops = {int(m.group(1)) for ln in first.out.splitlines() if (m := STOPPED_RE.search(ln))}
        if stops != {f.expected_resume}:
            return (f"after SIGTERM: 'stopped after step' lines {sorted(stops)}, the folder's latest complete "
                    f"checkpoint step-{f.expected_resume}")
    return None


def hang_problem(f: Facts) -> Optional[str]:
    """A hung rank whose heartbeat still beats: the others time out and one line names it (the
    rank the hook's marker says it hung) as the one that never reached their collective."""
    hung = re.search(r"hang_in_step rank (\d+) ", f.fired[0])
    line = next((ln for ln in f.first.out.splitlines() if "training fault:" in ln), "")
    if "a collective timed out" not in line:
        return f"no 'training fault: ... a collective timed out' line: {_tail(f.first.out)}"
    named = (f"rank {hung.group(1)} never reached the collective", f"behind the others: rank {hung.group(1)} ")
    if hung is None or not any(n in line for n in named):
        return f"the fault line does not name the hung rank ({f.fired[0]}): {line[:300]}"
    return None


def names_damage(out: str, fault: str, ckpt: Path, file: Path) -> bool:
    """Whether the rerun's output names the damaged checkpoint (and the file, where the reason does)."""
    prefix = "skipping checkpoint" if fault == "bad_metadata" else "skipping damaged checkpoint"
    return any(f"{prefix} {ckpt}:" in ln and (fault == "bad_metadata" or file.name in ln.split(":", 1)[1])
               for ln in out.splitlines())


def other_model_problem(f: Facts) -> Optional[str]:
    """The restart with another model: one config error, exit 2 on every rank, nothing trained,
    the checkpoint untouched."""
    out = f.rerun.out
    if not (f.rerun.rc == 2 or (f.rerun.rc != 0 and "exitcode  : 2" in out and "exitcode  : 1" not in out)):
        return f"the restart with another model exited {f.rerun.rc}, not 2 on every rank: {_tail(out)}"
    if not any("config error: checkpoint" in ln and "another model" in ln for ln in out.splitlines()):
        return f"no 'config error: checkpoint ... another model' line: {_tail(out)}"
    if step_lines(out):
        return f"the restart with another model trained steps {step_lines(out)}"
    return None if f.digest_equal else f"the checkpoint step-{STEPS} changed after the refused restart"


def verdict(f: Facts) -> Optional[str]:
    """None when the trial is identical (or ended in its one named line); else one line why not."""
    problem = first_run_problem(f)
    if problem is not None:
        return problem
    r, exp = f.rerun, f.expected_resume
    if r is None:
        return "no rerun"
    if r.timed_out:
        return f"the rerun timed out after {r.timeout_s:.0f} s"
    if f.fault == "other_model":
        return other_model_problem(f)
    if r.rc != 0:
        return f"the rerun exited {r.rc}: {_tail(r.out)}"
    if f.fault in DAMAGES and not names_damage(r.out, f.fault, f.damaged, f.damaged_file):
        return f"the rerun did not name the damaged checkpoint {f.damaged} ({f.damaged_file.name})"
    got = sorted({step for _, step in resumed(r.out)})
    if got != ([exp] if exp else []):
        return f"resumed from step {','.join(map(str, got)) or 0}, expected {exp} (the latest intact checkpoint)"
    steps = step_lines(r.out)
    if any(s <= exp for s in steps) or (exp < STEPS and steps[:1] != [exp + 1]):
        return f"the rerun printed steps {steps} after resuming at {exp}: it recomputed or skipped steps"
    if f.losses_diff:
        return f"losses differ from the uninterrupted run's: {f.losses_diff}"
    if f.digest_error:
        return f"the final checkpoint step-{STEPS} could not be read: {f.digest_error}"
    if not f.digest_equal:
        return f"the final weights' digest (step-{STEPS}) differs from the uninterrupted run's"
    return None


def got_resume(f: Facts) -> Optional[int]:
    """The step the rerun said it resumed from (0: none; None: no rerun, or another model)."""
    if f.rerun is None or f.fault == "other_model":
        return None
    return max((step for _, step in resumed(f.rerun.out)), default=0)
