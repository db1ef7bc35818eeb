"""The device choice: one module names device types; the CPU path never touches CUDA; what
the machine cannot do is one config error naming the key, before any process-group work."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from trainer_helpers import FAST

from trainer import config_checks, device
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
DEVICE_CHOOSERS = {ROOT / "trainer" / "device.py",  # the job's device
                   ROOT / "parallel" / "_torch.py",  # the fake world's (planning, dry runs)
                   ROOT / "parallel" / "_torch_memory.py",  # the CUDA allocator's history (profiling)
                   ROOT / "parallel" / "_torch_attention.py",  # the CUDA attention kernels (lowering)
                   ROOT / "parallel" / "measure.py"}  # the allocator's peak (CUDA: max_memory_allocated)


def _library() -> list[Path]:
    files = [ROOT / "train.py"]
    for top in ("models", "parallel", "trainer"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


def test_only_the_device_module_names_cuda():
    hits = []
    for path in _library():
        if path in DEVICE_CHOOSERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda":
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.cuda")
    assert not hits, "\n".join(hits)


class _NoCuda(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that sees or makes a CUDA tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten((args, kwargs, out))[0]:
            assert not (isinstance(t, torch.Tensor) and t.device.type == "cuda"), func
        return out


def test_cpu_jobs_never_touch_cuda(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the CPU path called into torch.cuda")

    for name in ("set_device", "max_memory_allocated", "synchronize", "current_device", "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    cfg = load_config("llama3_debug", [*FAST, "--job.device", "cpu", "--training.steps", "2", "--job.dump_folder",
                                       str(tmp_path)], world_size=1)
    with _NoCuda():
        tr = Trainer(cfg)
        losses = tr.train()
    assert tr.device.type == "cpu" and sorted(losses) == [1, 2]
    assert device.backend("cpu") == "gloo" and device.device_type("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--job.device", "cuda"], world_size=1)
    assert "'job.device' = 'cuda'" in str(e.value) and 'job.device = "cpu"' in str(e.value)
    assert device.device_type("auto") == "cpu"


def test_compile_without_a_compiler_is_one_config_error(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--job.device", "cpu", "--training.compile", "true"], world_size=1)
    assert "'training.compile' = True" in str(e.value) and "C++ compiler" in str(e.value)
    # with the fallback the run goes on (eagerly): no error at config time
    load_config("llama3_debug", ["--job.device", "cpu", "--training.compile", "true",
                                 "--training.compile_fallback", "true"], world_size=1)


def test_activation_checkpointing_without_blocks_is_one_config_error(monkeypatch):
    monkeypatch.setattr(config_checks, "transformer_blocks", lambda model: [])
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--activation_checkpoint.mode", "full"], world_size=1)
    assert "'activation_checkpoint.mode' = 'full'" in str(e.value) and "no transformer blocks" in str(e.value)
