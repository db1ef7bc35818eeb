"""The fault matrix (tools/fault_matrix.py, tools/fault_trials.py).

Quick: its pure parts, each shown able to fail: the resume step a checkpoint folder implies,
the step and resume lines, the verdict on recorded facts (an unfired fault, a rerun that
started over or recomputed a step, a wrong exit code, an unnamed damage, another digest), the
round-robin schedule, and a silent hang killed at its deadline with its whole process tree.

Slow: a representative subset that really runs (2 torchrun ranks, manual FSDP): a kill -9 of
one rank inside the checkpoint save (the hook's marker, the resume from the checkpoint before
the killed save) and a flipped byte in the latest checkpoint's shard (resumed from the one
before, the damage named), each ending with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path

import pytest
import xxhash

from tools import fault_matrix as fm
from tools import fault_trials as ft


def _checkpoint(ckpts: Path, step: int, manifest: bool = True, sizes_only: bool = False) -> Path:
    d = ckpts / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta" * 8)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    if manifest:
        files = {f.name: (f.stat().st_size if sizes_only else
                          {"bytes": f.stat().st_size, "xxh3_64": xxhash.xxh3_64(f.read_bytes()).hexdigest()})
                 for f in sorted(d.iterdir())}
        (d / "manifest.json").write_text(json.dumps({"hash": "xxh3_64", "files": files}))
    return d


def test_expected_resume_is_the_latest_checkpoint_whose_files_match_its_manifest(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert ft.expected_resume(ckpts) == 0  # no folder yet
    _checkpoint(ckpts, 2, sizes_only=True)  # an older manifest of sizes only
    _checkpoint(ckpts, 4)
    _checkpoint(ckpts, 6)
    _checkpoint(ckpts, 8, manifest=False)  # cannot be verified
    (ckpts / "step-10.tmp").mkdir()  # a killed save
    (ckpts / "step-12").mkdir()  # no .metadata
    assert ft.expected_resume(ckpts) == 6
    (ckpts / "step-4" / "__0_0.distcp").write_bytes(b"short")
    assert ft.expected_resume(ckpts) == 6 and ft.expected_resume(ckpts, exclude=ckpts / "step-6") == 2
    ckpt, _, _ = ft.damage(ckpts, "truncate_shard")  # the latest intact one, not step-12 or step-8
    assert ckpt.name == "step-6" and ft.expected_resume(ckpts) == 2


def test_damage_changes_the_latest_checkpoint_and_the_expected_resume_moves_back(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _checkpoint(ckpts, step)
    size = (ckpts / "step-6" / "__0_0.distcp").stat().st_size
    ckpt, file, changed = ft.damage(ckpts, "flip_byte")
    assert (ckpt.name, file.name, changed) == ("step-6", "__0_0.distcp", True)
    assert file.stat().st_size == size and not ft.intact(ckpt)
    assert ft.expected_resume(ckpts) == 4
    ckpt, file, changed = ft.damage(ckpts, "missing_manifest")  # the latest intact one: step-4
    assert (ckpt.name, file.name, changed) == ("step-4", "manifest.json", True) and not file.exists()
    assert ft.expected_resume(ckpts) == 2
    ckpt, file, changed = ft.damage(ckpts, "bad_metadata")  # step-2: its manifest updated to match
    assert ckpt.name == "step-2" and changed and file.read_bytes() == ft.GARBAGE
    assert ft.intact(ckpt)  # the checksums pass: only the exclusion moves the resume back
    assert ft.expected_resume(ckpts) == 2 and ft.expected_resume(ckpts, exclude=ckpt) == 0


def test_step_and_resume_lines():
    out = ("W1206 torch/distributed/run.py:874] *****\n"
           "resumed from /tmp/x y/job/checkpoints/step-4 at step 4\n"
           "step 5 | loss 6.0408 | grad_norm 1.82 | lr 4.5e-04\n"
           "step 5 | validation loss 6.1 | perplexity 400.00 | 128 tokens\n"
           "step 6: sequence length 16 -> 32: solved\n"
           "step 6 | loss 5.7565 | grad_norm 1.89\n")
    assert ft.step_lines(out) == [5, 6]
    assert ft.resumed(out) == [("/tmp/x y/job/checkpoints/step-4", 4)]
    assert ft.resumed("step 1 | loss 6.0\n") == []


def _out(resume: int, steps: range, extra: str = "") -> str:
    head = f"resumed from /f/job/checkpoints/step-{resume} at step {resume}\n" if resume else ""
    return head + extra + "".join(f"step {s} | loss 5.{s} | grad_norm 1.0\n" for s in steps)


def _facts(fault: str = "kill_step", **kw) -> ft.Facts:
    f = ft.Facts("manual", 2, fault, first=ft.Run(1, "step 3 | loss 5.0\n"), fired=["SIGKILL rank 1 pid 9"],
                 expected_resume=2, rerun=ft.Run(0, _out(2, range(3, 9))), digest_equal=True)
    for k, v in kw.items():
        setattr(f, k, v)
    return f


def test_the_verdict_fails_each_thing_a_trial_must_show():
    assert ft.verdict(_facts()) is None
    assert ft.verdict(_facts(fired=[])) == "fault did not fire"
    assert "exited 0 although a rank was killed" in ft.verdict(_facts(first=ft.Run(0, "")))
    assert "timed out after 300 s" in ft.verdict(_facts(first=ft.Run(None, "", timed_out=True, timeout_s=300)))
    # a rerun that started over: deterministic training gives the same losses, the resume step tells
    assert ft.verdict(_facts(rerun=ft.Run(0, _out(0, range(1, 9))))) == \
        "resumed from step 0, expected 2 (the latest intact checkpoint)"
    assert "recomputed or skipped" in ft.verdict(_facts(rerun=ft.Run(0, _out(2, range(1, 9)))))
    assert "recomputed or skipped" in ft.verdict(_facts(rerun=ft.Run(0, _out(2, range(4, 9)))))
    assert "the rerun exited 1" in ft.verdict(_facts(rerun=ft.Run(1, "training fault: x\n")))
    assert "losses differ" in ft.verdict(_facts(losses_diff="step 3: 1.0 vs 2.0 uninterrupted"))
    assert "digest" in ft.verdict(_facts(digest_equal=False))
    # SIGTERM (to all or to one rank): exit 0, and a stop at the folder's latest checkpoint
    stop = ft.Run(0, "stopped after step 2 on SIGTERM: checkpoint step-2 in /f; run the same command\n")
    assert ft.verdict(_facts("sigterm_one", first=stop)) is None
    assert "exited 1, not 0" in ft.verdict(_facts("sigterm_one", first=ft.Run(1, "x\n")))
    assert "'stopped after step' lines [2]" in ft.verdict(_facts("sigterm", first=stop, expected_resume=4,
                                                                   rerun=ft.Run(0, _out(4, range(5, 9)))))


def test_the_verdict_wants_the_damage_named_and_another_model_refused():
    ckpt = Path("/f/job/checkpoints/step-4")
    named = f"skipping damaged checkpoint {ckpt}: {ckpt}/__0_0.distcp does not match its checksum\n"
    kw = dict(first=ft.Run(0, ""), damaged=ckpt, damaged_file=ckpt / "__0_0.distcp")
    assert ft.verdict(_facts("flip_byte", rerun=ft.Run(0, _out(2, range(3, 9), named)), **kw)) is None
    assert "did not name the damaged checkpoint" in ft.verdict(_facts("flip_byte", **kw))
    loaded = f"skipping checkpoint {ckpt}: it could not be loaded (UnpicklingError: invalid load key)\n"
    kw["damaged_file"] = ckpt / ".metadata"
    assert ft.verdict(_facts("bad_metadata", rerun=ft.Run(0, _out(2, range(3, 9), loaded)), **kw)) is None
    assert "did not name" in ft.verdict(_facts("bad_metadata", rerun=ft.Run(0, _out(2, range(3, 9), named)), **kw))
    refused = "config error: checkpoint /f was written by another model: missing x\n  exitcode  : 2\n"
    other = dict(first=ft.Run(0, ""), fired=["restarted"])
    assert ft.verdict(_facts("other_model", rerun=ft.Run(1, refused), **other)) is None
    assert "changed after" in ft.verdict(_facts("other_model", rerun=ft.Run(1, refused), digest_equal=False, **other))
    assert "exited 0, not 2" in ft.verdict(_facts("other_model", rerun=ft.Run(0, _out(0, range(1, 9))), **other))


def test_the_verdict_wants_a_hung_rank_named():
    fired = ["hang_in_step rank 1 pid 7 in optimizer step 3"]
    line = ("training fault: step 3: a collective timed out after 15 s ([comm] timeout_s); stalled: no rank's "
            "heartbeat stopped; rank {r} never reached the collective the others timed out in (...)\n")
    assert ft.verdict(_facts("hang_step", first=ft.Run(1, line.format(r=1)), fired=fired)) is None
    assert "does not name the hung rank" in ft.verdict(_facts("hang_step", first=ft.Run(1, line.format(r=0)),
                                                              fired=fired))
    assert "no 'training fault" in ft.verdict(_facts("hang_step", first=ft.Run(1, "x\n"), fired=fired))
    assert "exited 0" in ft.verdict(_facts("hang_step", first=ft.Run(0, line.format(r=1)), fired=fired))


def test_trials_go_round_robin_over_the_faults_of_the_mode():
    manual = fm.schedule(ft.FAULTS, "manual", 20)
    assert len(manual) == 20 and not set(manual) & set(ft.AUTO_ONLY)
    assert set(manual) == set(ft.FAULTS) - set(ft.AUTO_ONLY) and manual[:2] == ["kill_step", "kill_save_all"]
    assert set(fm.schedule(ft.FAULTS, "auto", 20)) == set(ft.FAULTS)
    assert fm.schedule(("kill_planning",), "manual", 5) == []
    with pytest.raises(SystemExit):
        fm.main(["--faults", "kill_everything"])


def test_the_replan_trigger_waits_for_the_replan():
    trigger, _, _ = ft.inject("kill_replan", 2, Path("/nonexistent"), random.Random(0))
    assert [trigger(ln) for ln in ("trace: JointGraph", "step 4 | loss 6.0", "saved checkpoint x", "trace: J")] == \
        [False, False, False, True]


def test_a_silent_hang_times_out_and_its_whole_tree_is_killed():
    # the child starts a grandchild in a session of its own (as torchrun starts its workers)
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            "print(p.pid, flush=True)\ntime.sleep(120)\n")
    t0 = time.time()
    r = ft.run([sys.executable, "-c", code], timeout=3)
    assert r.timed_out and r.rc is None and time.time() - t0 < 30
    grandchild = Path(f"/proc/{int(r.out.split()[0])}/stat")
    deadline = time.time() + 10
    while grandchild.exists() and time.time() < deadline and " Z " not in grandchild.read_text():
        time.sleep(0.1)
    assert not grandchild.exists() or " Z " in grandchild.read_text()


def test_a_trigger_that_never_matches_fires_nothing():
    r = ft.run([sys.executable, "-c", "print('step 1 | loss 1.0')"], timeout=30,
               trigger=lambda ln: ln.startswith("step 9 |"), fire=lambda pid: ["fired"])
    assert (r.rc, r.fired, r.timed_out) == (0, [], False)
    r = ft.run([sys.executable, "-c", "print('step 1 | loss 1.0')"], timeout=30,
               trigger=lambda ln: ln.startswith("step 1 |"), fire=ft.signal_workers(lambda found: [0], 9))
    assert r.fired == []  # no worker with RANK=0 under it: nothing sent, so nothing fired


@pytest.mark.slow
def test_a_kill_in_the_save_and_a_flipped_byte_resume_from_the_right_step(tmp_path):
    rows = fm.matrix("manual", 2, ("kill_save_one", "flip_byte"), 2, tmp_path, random.Random(0), timeout=300)
    text = "\n".join(map(fm.row_text, rows))
    assert [r.fault for r in rows] == ["kill_save_one", "flip_byte"], text
    kill, flip = rows[0].facts[0], rows[1].facts[0]
    assert ft.verdict(kill) is None and ft.verdict(flip) is None, text
    # the hook's marker: the rank and the save it killed; the resume is the checkpoint before that save
    marker = re.search(r"kill_in_save rank \d pid \d+ writing .*/step-(\d+)\.tmp", " ".join(kill.fired))
    assert marker, kill.fired
    assert kill.first.rc != 0 and ft.got_resume(kill) == kill.expected_resume == int(marker.group(1)) - ft.INTERVAL
    assert flip.damaged.name == f"step-{ft.STEPS}" and flip.fired == [f"flip_byte: {flip.damaged_file}"]
    assert ft.got_resume(flip) == flip.expected_resume == ft.STEPS - ft.INTERVAL
    assert all(f.digest_equal and not f.losses_diff for f in (kill, flip))
    assert " ok " in text and "FAILED" not in text
    assert fm.summary(rows).endswith("every trial identical or ending in its named line")
