"""The fault matrix's representative subset (tools/fault_matrix.py): 2 torchrun ranks, manual
FSDP; a kill -9 of one rank inside the checkpoint save ends in a restart, with the same
command, whose losses equal the uninterrupted run's bit for bit. The matrix's other faults
are tested in-process: a truncated or deleted shard, SIGTERM, a stopped rank in
tests/trainer/test_faults.py, a kill before the rename in tests/trainer/test_checkpoint.py."""

import pytest


@pytest.mark.slow
def test_faults_are_survived_with_identical_losses(capsys):
    from tools import fault_matrix as fm

    rc = fm.main(["--modes", "manual", "--worlds", "2", "--trials", "1", "--faults",
                  "kill_save_one"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("manual ")]
    assert {r[2] for r in rows} == {"kill_save_one"}
    assert all(r[5] == "yes" for r in rows), out
    assert "fault matrix: every trial identical" in out
