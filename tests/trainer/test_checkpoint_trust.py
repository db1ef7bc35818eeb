"""Checkpoints a cluster can trust: content checksums in the manifest, no code run from a
checkpoint folder (a planted pickle is refused naming its file), `[checkpoint] trust_foreign`."""

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import CheckpointManager, complete_checkpoints
from trainer.checkpoint_files import MANIFEST, UnsafeCheckpoint, damage, dcp_load, write_manifest
from trainer.errors import ConfigError
from trainer.hf_checkpoint import load_dcp_model
from trainer.trainer import Trainer

CKPT = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2"]
TRUST = ["--checkpoint.trust_foreign", "true"]


class Payload:
    """Unpickling it creates `marker` (what a hostile checkpoint would do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder))


def test_a_same_size_change_fails_its_checksum_and_a_missing_manifest_is_named(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"m" * 10)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    write_manifest(tmp_path, {})
    assert damage(tmp_path) is None
    entry = json.loads((tmp_path / MANIFEST).read_text())["files"]["__0_0.distcp"]
    assert entry["bytes"] == 16384 and len(entry["xxh3_64"]) == 16
    data = bytearray((tmp_path / "__0_0.distcp").read_bytes())
    data[5000] ^= 1  # one bit, the size unchanged
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    assert damage(tmp_path).startswith(f"{tmp_path / '__0_0.distcp'} does not match its checksum (xxh3_64 ")
    (tmp_path / MANIFEST).unlink()
    assert "has no manifest.json" in damage(tmp_path) and "'checkpoint.trust_foreign' = true" in damage(tmp_path)
    assert damage(tmp_path, trust_foreign=True) is None and damage(tmp_path, manifest_optional=True) is None


def test_planted_pickles_are_refused_naming_the_file_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    # a non-tensor item that runs code
    item = tmp_path / "item"
    _save({"model": {"w": torch.ones(3)}, "extra": Payload(marker)}, item)
    with pytest.raises(UnsafeCheckpoint) as e:
        dcp_load({"model": {"w": torch.empty(3)}, "extra": 0}, item)
    assert e.value.file == str(item / "__0_0.distcp")
    assert e.value.reason.startswith("item extra is not plain data (it names ")
    assert not marker.exists()
    # a .metadata that runs code (an initial_load_path someone sent)
    meta = tmp_path / "meta"
    _save({"model": {"w": torch.ones(3)}}, meta)
    md = pickle.loads((meta / ".metadata").read_bytes())
    md.planner_data["x"] = Payload(marker)
    (meta / ".metadata").write_bytes(pickle.dumps(md))
    sd = {"w": torch.empty(3)}
    with pytest.raises(ConfigError) as e:
        load_dcp_model(sd, meta, "this model")
    msg = str(e.value)
    assert msg.startswith(f"{meta / '.metadata'}: refused, it names pathlib.Path.touch, which is not one of DCP's")
    assert "'checkpoint.trust_foreign' = true" in msg and "\n" not in msg
    assert not marker.exists()
    # the flag reads both with DCP's own unpickling: the code runs
    load_dcp_model(sd, meta, "this model", trust_foreign=True)
    assert marker.exists() and torch.equal(sd["w"], torch.ones(3))


def test_the_loader_state_is_json_and_a_planted_or_pickled_one_is_refused(cfg_factory, tmp_path, monkeypatch):
    Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "2"], job="json")).train()
    md = pickle.loads((tmp_path / "json" / "checkpoints" / "step-2" / ".metadata").read_bytes())
    assert "dataloader.dp_rank_0" in md.state_dict_metadata

    real = CheckpointManager._state
    marker = tmp_path / "marker"
    for job, value in (("planted", lambda sd: Payload(marker)), ("pickled", pickle.dumps)):
        def state(self, step, value=value):
            out = real(self, step)
            out["dataloader"] = {k: value(self.dataloader.state_dict()) for k in out["dataloader"]}
            return out

        monkeypatch.setattr(CheckpointManager, "_state", state)
        Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "2"], job=job)).train()
        monkeypatch.setattr(CheckpointManager, "_state", real)
        folder = tmp_path / job / "checkpoints"
        with pytest.raises(ConfigError) as e:
            Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "3"], job=job)).train()
        assert "\n" not in str(e.value) and "'checkpoint.trust_foreign' = true" in str(e.value)
        if job == "planted":
            assert str(e.value).startswith(f"{folder / 'step-2' / '__0_0.distcp'}: refused, item dataloader.dp_rank_0")
        else:
            assert str(e.value).startswith(f"{folder / 'step-2'}: the data-loader state is stored with pickle")
        assert not marker.exists() and sorted(complete_checkpoints(folder)) == [2]  # nothing deleted
    # a checkpoint of an older autotitan: its pickled loader state loads with the flag
    tr = Trainer(cfg_factory(extra=[*CKPT, *TRUST, "--training.steps", "3"], job="pickled"))
    assert sorted(tr.train()) == [3]


def test_no_usable_checkpoint_stops_the_job_and_deletes_nothing(cfg_factory, tmp_path):
    Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "2"], job="j")).train()
    folder = tmp_path / "j" / "checkpoints"
    (folder / "step-2" / MANIFEST).unlink()
    files = sorted(p.name for p in (folder / "step-2").iterdir())
    with pytest.raises(ConfigError, match=r"^no usable checkpoint in .*step-2: .* has no manifest\.json .*nothing "
                                          r"was deleted"):
        Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "4"], job="j"))
    with pytest.raises(ConfigError, match=r"^'checkpoint.load_step' = 2: .* has no manifest\.json"):
        Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "4", "--checkpoint.load_step", "2"], job="j"))
    assert sorted(p.name for p in (folder / "step-2").iterdir()) == files
    tr = Trainer(cfg_factory(extra=[*CKPT, *TRUST, "--training.steps", "3"], job="j"))
    assert tr.resume_step == 2 and sorted(tr.train()) == [3]
