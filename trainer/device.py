"""Where the job runs: the one place that names a device type.

`[job] device = "auto" | "cuda" | "cpu"`: auto takes CUDA when torch sees a GPU. CUDA
jobs use NCCL and one GPU per rank (torchrun's LOCAL_RANK); CPU jobs use gloo. Every
other module takes the device (or its type) from here, so the same code runs on an
H100 node and on this CPU machine.
"""

from __future__ import annotations

import os
import shutil

import torch

CPU, CUDA = "cpu", "cuda"


def device_type(name: str = "auto") -> str:
    """"cuda" or "cpu" for a `[job] device` value (auto: CUDA when available)."""
    if name == "auto":
        return CUDA if torch.cuda.is_available() else CPU
    return name


def simulated_device(name: str = "auto") -> torch.device:
    """The device a dry run fakes for a `[job] device` value: the rank's GPU unless the job
    says cpu ("auto" is a GPU cluster: what the dry run is for)."""
    return torch.device(CPU) if name == CPU else torch.device(CUDA, 0)


def check_fake_cuda() -> str | None:
    """Why a dry run cannot fake CUDA tensors here, or None. A CPU-only torch build gets a
    no-op CUDA device guard compiled with the C++ compiler (parallel/_torch.py)."""
    if torch.backends.cuda.is_built():
        return None
    why = check_compiler(CPU)
    return None if why is None else (f"a dry run on fake CUDA tensors needs a C++ compiler on this CPU-only torch "
                                     f"({why.split(';')[0]}); install one, or simulate a CPU job with --job.device cpu")


def check_device(name: str) -> str | None:
    """Why `name` cannot be used on this machine, or None."""
    if name == CUDA and not torch.cuda.is_available():
        return ("CUDA is not available on this machine (no GPU visible to torch, or a CPU-only torch build); "
                'set job.device = "cpu", or "auto" to use a GPU only where there is one')
    return None


def check_compiler(name: str) -> str | None:
    """Why Inductor cannot compile here, or None: on CPU it needs a C++ compiler."""
    if device_type(name) != CPU:
        return None
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        return ("Inductor needs a C++ compiler on CPU and none was found (CXX, g++, c++, clang++); install one "
                "(e.g. apt-get install g++), or set training.compile = false, or training.compile_fallback = "
                "true to run eagerly")
    return None


def local_device(name: str = "auto") -> torch.device:
    """This process's device: its GPU (LOCAL_RANK) for CUDA jobs, the CPU otherwise."""
    if device_type(name) == CUDA:
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device(CUDA, index)
    return torch.device(CPU)


def sharded_init_is_exact(device: torch.device) -> bool:
    """True where DTensor's random ops give each shard the values a single-device init would
    (CUDA's offset-based RNG tracker): then ranks initialise only their shards. On CPU they
    do not, so every rank initialises the whole model and keeps its shards."""
    return device.type == CUDA


GPU_PROFILES = {"H100": "h100", "H200": "h200", "A100": "a100"}


def gpu_profile() -> str | None:
    """The shipped hardware profile of this process's GPU (by its name), or None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((p for key, p in GPU_PROFILES.items() if key in name), None)


def backend(name: str = "auto") -> str:
    """The process-group backend for the device: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device_type(name) == CUDA else "gloo"


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on a GPU since the start, or since `reset_peak_memory` (the trainer
    resets it after its warm-up); None on CPU: the caller measures RSS."""
    if device.type == CUDA:
        return torch.cuda.max_memory_allocated(device)
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new window for `peak_memory_bytes` (the timed steps' peak, not the setup's; a
    no-op on CPU)."""
    if device.type == CUDA:
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing a GPU step needs it; a no-op on CPU)."""
    if device.type == CUDA:
        torch.cuda.synchronize(device)
