"""Step metrics: loss, grad norm, lr, tokens/s, MFU, memory -> console (rank 0) and
TensorBoard scalars under ``<dump_folder>/<job.name>/tb``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from parallel.auto.cost import AUTO, load_hardware
from parallel.precision import dtype_of

from .device import gpu_profile, peak_memory_bytes

logger = logging.getLogger("autotitan")


def setup_logging(rank: int) -> None:
    """Console logging for the trainer and the planner (whose progress — tracing,
    candidates, problem size, solve with objective — is long work worth seeing)."""
    if logger.handlers:
        return
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("[rank%d] %%(message)s" % rank if rank else "%(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    planner = logging.getLogger("parallel.auto")  # keeps propagating: callers' handlers still see it
    planner.addHandler(h)
    planner.setLevel(logging.INFO if rank == 0 else logging.WARNING)


# --------------------------------------------------------------------------- hardware


_MEASURED_CPU_PEAK: Optional[float] = None


def measure_cpu_peak_flops(seconds: float = 0.2, n: int = 512, trials: int = 5) -> float:
    """fp32 matmul throughput of this process (FLOP/s), measured once (~0.2 s): the
    best of ``trials`` short bursts, so a busy machine disturbs it less."""
    global _MEASURED_CPU_PEAK
    if _MEASURED_CPU_PEAK is None:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        torch.mm(a, b)  # warm up
        best = 0.0
        for _ in range(trials):
            iters, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                iters += 1
                dt = time.perf_counter() - t0
                if dt >= seconds / trials:
                    break
            best = max(best, 2.0 * n ** 3 * iters / dt)
        _MEASURED_CPU_PEAK = best
    return _MEASURED_CPU_PEAK


def peak_flops(hardware: str, dtype: str = "float32") -> tuple[Optional[float], str]:
    """Peak FLOP/s per device for a hardware profile and compute dtype, and a note.

    ``cpu`` is measured (fp32 matmul, once): the shared machine's figure beats a profile's.
    Other names are read by the planner's loader (configs/hardware/NAME.toml or a path),
    the same profile the cost model uses; the config validated that it loads."""
    if hardware == AUTO:
        gpu = gpu_profile()
        if gpu is None:
            return measure_cpu_peak_flops(), "auto: measured fp32 matmul peak"
        hardware = gpu
    if hardware == "cpu":
        return measure_cpu_peak_flops(), "cpu: measured fp32 matmul peak"
    hw = load_hardware(hardware)
    return hw.peak_flops(dtype_of(dtype)), f"{hardware}: peak_tflops ({dtype})"


# --------------------------------------------------------------------------- memory


def cpu_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_bytes(device: torch.device) -> int:
    """Peak GPU bytes allocated on a GPU; the process's resident memory on a CPU."""
    peak = peak_memory_bytes(device)
    return peak if peak is not None else cpu_rss_bytes()


# --------------------------------------------------------------------------- logger


class MetricsLogger:
    """Collects per-step numbers; every ``log_freq`` steps prints one line (rank 0) and
    writes TensorBoard scalars; keeps ``losses.json`` ({step: loss}) in the run folder.

    losses.json is rewritten whole, so on a long run it is written at most every
    ``LOSSES_WRITE_S`` seconds, at each checkpoint (``flush``: a resumed run reads every step up
    to its checkpoint from it) and at ``close``; a rewrite per step grew the step time by ~15 %
    over 3,000 steps."""

    LOSSES_WRITE_S = 10.0

    def __init__(self, metrics_cfg, run_dir: Path, *, rank: int, world_size: int,
                 flops_per_token: float, compute_dtype: str, device: torch.device, start_step: int = 0):
        self.cfg = metrics_cfg
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.run_dir = run_dir
        self.losses_path = run_dir / "losses.json"
        self.peak, self.peak_note = (None, "")
        if rank == 0:
            self.peak, self.peak_note = peak_flops(metrics_cfg.hardware, compute_dtype)
        self.losses: dict[str, float] = {}
        self.grad_norms: dict[str, float] = {}
        self.val_losses: dict[str, float] = {}
        self._unwritten = False
        self._written_at = time.monotonic()
        if rank == 0 and start_step > 0 and self.losses_path.exists():
            try:
                old = json.loads(self.losses_path.read_text())
                self.losses = {k: v for k, v in old.get("loss", {}).items()
                               if int(k) <= start_step}
                self.grad_norms = {k: v for k, v in old.get("grad_norm", {}).items()
                                   if int(k) <= start_step}
                self.val_losses = {k: v for k, v in old.get("validation", {}).items() if int(k) <= start_step}
            except (ValueError, OSError):
                pass
        self.tb = None
        if rank == 0 and metrics_cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        self._tokens = 0
        self._t0 = time.perf_counter()
        self.last: dict[str, float] = {}

    def add_tokens(self, n_global_tokens: int) -> None:
        """Tokens of the global batch trained on in one step."""
        self._tokens += n_global_tokens

    def should_log(self, step: int, last_step: int) -> bool:
        return step % self.cfg.log_freq == 0 or step == last_step or step == 1

    def log(self, step: int, loss: float, grad_norm: float, lr: float) -> dict:
        dt = max(time.perf_counter() - self._t0, 1e-9)
        tps = self._tokens / dt  # global tokens/s
        # model FLOPs per second per device vs the device's peak
        mfu = (100.0 * tps * self.flops_per_token / (self.world_size * self.peak)
               if self.peak else None)
        mem = memory_bytes(self.device)
        m = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tps,
             "mfu_pct": mfu, "memory_gib": mem / 2**30}
        self.last = m
        if self.rank == 0:
            mfu_s = f"{mfu:.1f}%" if mfu is not None else "n/a"
            logger.info(f"step {step} | loss {loss:.4f} | grad_norm {grad_norm:.2f} | "
                        f"lr {lr:.1e} | tok/s {tps:.0f} | mfu {mfu_s} | "
                        f"mem {mem / 2**30:.2f} GiB")
            self.losses[str(step)] = loss
            self.grad_norms[str(step)] = grad_norm
            self._unwritten = True
            if time.monotonic() - self._written_at >= self.LOSSES_WRITE_S:
                self._write_losses()
            if self.tb is not None:
                for k, v in m.items():
                    if v is not None:
                        self.tb.add_scalar(f"train/{k}", v, step)
                self.tb.flush()
        self._tokens = 0
        self._t0 = time.perf_counter()
        return m

    def log_validation(self, step: int, loss: float, perplexity: float, tokens: int) -> None:
        """`[validation]`'s numbers of a step: one console line (rank 0), TensorBoard scalars
        validation/loss and validation/perplexity, and losses.json's "validation" ({step: loss})."""
        if self.rank != 0:
            return
        logger.info(f"step {step} | validation loss {loss:.4f} | perplexity {perplexity:.2f} | {tokens} tokens")
        self.val_losses[str(step)] = loss
        self._write_losses()
        if self.tb is not None:
            self.tb.add_scalar("validation/loss", loss, step)
            self.tb.add_scalar("validation/perplexity", perplexity, step)
            self.tb.flush()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """TensorBoard scalars logged once, not every step (rank 0): the measured step beside
        the predicted one after the warm-up (trainer/measured.py)."""
        if self.tb is None:
            return
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def reset_timer(self) -> None:
        self._tokens = 0
        self._t0 = time.perf_counter()

    def flush(self) -> None:
        """Write losses.json now if a logged step is not in it yet (rank 0)."""
        if self.rank == 0 and self._unwritten:
            self._write_losses()

    def _write_losses(self) -> None:
        self._unwritten = False
        self._written_at = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.losses_path.with_suffix(".json.tmp")
        d = {"loss": self.losses, "grad_norm": self.grad_norms}
        if self.val_losses:
            d["validation"] = self.val_losses
        tmp.write_text(json.dumps(d))
        os.replace(tmp, self.losses_path)

    def close(self) -> None:
        self.flush()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
