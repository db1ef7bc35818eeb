"""The main job's path calls no deprecated torch API: on 2 gloo ranks, the hardware
calibration's collectives (what `hardware = "auto"` measures), a manual (FSDP2) job and an
auto-mode job train a few steps of a tiny LLaMA while every warning is recorded; not one
FutureWarning or DeprecationWarning may appear.

Every warning is recorded, not only those attributed to our modules: torch's deprecated
collectives warn through its own `c10d_logger` wrapper, so a filter on `module=` (the
frame the warning is attributed to) would miss exactly the calls this test is about.
No torch-internal warning needed an exception (torch 2.13): ALLOWED is empty.
"""

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel" / "recipes"))
from dist_utils import run_distributed  # noqa: E402

TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false"]
ALLOWED: tuple[str, ...] = ()
"""Exact messages of torch-internal deprecation warnings our calls cannot avoid (none today)."""


def _deprecations(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning)) and str(w.message) not in ALLOWED]


def _worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from parallel.auto.cost import calibrate
    from trainer.config import load_config
    from trainer.trainer import Trainer

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in calibrate.COLLECTIVE_KINDS:
            calibrate._collective_fn(kind, 64 * world, None, None)()
        calibrate.measure_stream_latency(k=2, reps=1)
        dist.barrier()
        out["calibration"] = _deprecations(caught)
    for mode in ("manual", "auto"):
        extra = ["--parallelism.hardware", "cpu"] if mode == "auto" else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config("llama3_debug", [*TINY, "--parallelism.mode", mode, *extra,
                                               "--job.dump_folder", tmp, "--job.name", mode], world_size=world)
            losses = Trainer(cfg).train()
        out[mode] = _deprecations(caught)
        out[mode + "_steps"] = sorted(losses)
    return out


@pytest.mark.slow
def test_main_path_prints_no_deprecation_warnings(tmp_path):
    for rank, out in enumerate(run_distributed(_worker, 2, str(tmp_path), timeout=300)):
        assert out["manual_steps"] == [1, 2] and out["auto_steps"] == [1, 2], out
        for part in ("calibration", "manual", "auto"):
            assert out[part] == [], f"rank {rank}, {part}: " + "\n".join(out[part])
