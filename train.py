"""autotitan training entry point.

    python train.py --config llama3_debug [--section.key value ...]
    torchrun --nproc_per_node=2 train.py --config llama3_debug.toml
    python train.py --config llama3_debug --print-config

The config is loaded and validated (including the parallelism degrees against
WORLD_SIZE) before any process-group work. A configuration error -- of the config itself,
of a recipe, of the planner (no feasible plan, a plan file that does not fit) or of a
hardware profile -- ends the run on every rank with exit code 2; rank 0 prints it as one
line naming the cause and the fix, without a traceback.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from parallel.auto.cost import ProfileError
from parallel.auto.plan import PlanMismatchError
from parallel.auto.problem.placement_problem import PlanningError
from parallel.recipes import RecipeError
from trainer.config import ConfigError, JobConfig, load_config
from trainer.config_checks import validate_config
from trainer.device import backend, local_device
from trainer.dry_run_pipeline import dry_run_main
from trainer.errors import TrainingFault
from trainer.mesh_auto import resolve_mesh
from trainer.trainer import Trainer

USER_ERRORS = (ConfigError, RecipeError, PlanningError, PlanMismatchError, ProfileError)
"""What the user fixes in the config: reported as one line, exit code 2. The trainer turns
the lower layers' errors into ConfigErrors naming the key; the others are listed so that
one that slips through is still reported the same way."""
EXIT_CONFIG_ERROR = 2
EXIT_FAULT = 1
REPORT_GRACE_S = 5.0
"""How long the other ranks wait before exiting on such an error: torchrun stops every rank
once one has exited, so rank 0, which prints the error, must not be stopped first."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The entry point's own flags; everything else is a --section.key override."""
    ap = argparse.ArgumentParser(
        description="Train an LLM with autotitan.",
        epilog="Any --section.key value pair overrides the config, e.g. "
               "--training.steps 10 --checkpoint.enable true")
    ap.add_argument("--config", default="llama3_debug",
                    help="a TOML file, or a bare NAME for configs/NAME.toml")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config as TOML and exit")
    ap.add_argument("--dry-run", action="store_true",
                    help="simulate one step on a fake world (no GPU, no real memory) and print "
                         "per-rank memory and collectives (trainer/dry_run.py)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="number of ranks to simulate with --dry-run")
    return ap.parse_known_args(argv)


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> bool:
    """The process group from torchrun's env vars (NCCL on GPUs, gloo on CPUs); none for a
    plain single process. `timeout_s`: how long its start and every collective may wait."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ or (
            os.environ["WORLD_SIZE"] == "1" and "MASTER_ADDR" not in os.environ):
        return False
    local_device(device)  # a GPU rank binds its GPU before NCCL starts
    dist.init_process_group(backend(device), timeout=timedelta(seconds=timeout_s))
    return True


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def report(message: str, kind: str = "config error", reporting_rank: int = 0) -> int:
    """One rank (rank 0, unless it is the one that stalled) prints the error as one line (every
    rank raised the same one); all exit 2 for a config error, 1 for a fault."""
    if _rank() == reporting_rank:
        print(f"{kind}: " + " ".join(message.split("\n")), file=sys.stderr, flush=True)
    else:
        time.sleep(REPORT_GRACE_S)
    return EXIT_CONFIG_ERROR if kind == "config error" else EXIT_FAULT


def train(cfg: JobConfig) -> None:
    """Run the job, in a process group when torchrun started us."""
    started = init_distributed(cfg.job.device, cfg.comm.timeout_s)
    try:
        Trainer(resolve_mesh(cfg)).train()  # mesh = "auto": the searched mesh's degrees
        if started:  # every rank done with its collectives before gloo is torn down
            dist.barrier()
    finally:
        if started:
            dist.destroy_process_group()
            gc.collect()  # see main


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """Dry run, print the config, or train: what the flags ask for."""
    if args.dry_run:  # fake-world simulation, no process group
        ws = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        cfg = load_config(args.config, overrides, world_size=ws, validate=False)
        validate_config(cfg, ws, simulated_device=True)  # the device is faked: it need not be here
        return dry_run_main(cfg, ws)
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(f"# resolved from {cfg.source}")
        print(cfg.to_toml())
        return 0
    train(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        return run(args, overrides)
    except TrainingFault as e:
        message, rank = str(e), e.reporting_rank
        del e
        gc.collect()
        return report(message, "training fault", rank)
    except USER_ERRORS as e:
        error: Exception = e
    # The error's frames still hold the mesh and its gloo groups; freed at interpreter exit,
    # gloo's threads abort the process (SIGABRT instead of exit code 2). Free them now.
    message = str(error)
    del error
    gc.collect()
    return report(message)


if __name__ == "__main__":
    sys.exit(main())
