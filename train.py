"""autotitan training entry point.

    python train.py --config llama3_debug [--section.key value ...]
    torchrun --nproc_per_node=2 train.py --config llama3_debug.toml
    python train.py --config llama3_debug --print-config

The config is loaded and validated (including the parallelism degrees against
WORLD_SIZE) before any process-group work; errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta


def parse_args(argv=None):
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


def init_distributed():
    """gloo process group from torchrun's env vars; none for a plain single process."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ or (
            os.environ["WORLD_SIZE"] == "1" and "MASTER_ADDR" not in os.environ):
        return False
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return True


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    from trainer.config import ConfigError, load_config
    if args.dry_run:  # recipes helper: fake-world simulation, no process group
        from trainer.dry_run import main as dry_run_main
        ws = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        try:
            return dry_run_main(load_config(args.config, overrides, world_size=ws), ws)
        except (ConfigError, ValueError) as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(f"# resolved from {cfg.source}")
        print(cfg.to_toml())
        return 0
    started = init_distributed()
    try:
        from trainer.trainer import Trainer
        try:
            Trainer(cfg).train()
            if started:  # every rank done with its collectives before gloo is torn down
                import torch.distributed as dist
                dist.barrier()
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    finally:
        if started:
            import torch.distributed as dist
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
