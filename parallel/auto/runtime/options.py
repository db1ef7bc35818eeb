"""How a plan runs (not what it places): the runtime's knobs, one object handed down."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.activation_checkpoint import AC_CHOICES, block_policies
from parallel.settings import AC_MODES


@dataclass(frozen=True)
class RuntimeOptions:
    """Options of the ParallelModule a plan becomes.

    ac_mode / ac_option: activation checkpointing of the joint graph, as
        `[activation_checkpoint] mode` / `selective_ac_option` ("op" or every N-th block);
    ac_blocks: one `AC_CHOICES` entry per transformer block ("none", "op": per-op SAC, "full"),
        in the model's block order (a plan's per-block choice); set, it overrides ac_mode /
        ac_option, and its length must be the model's number of blocks;
    reshard_after_forward: gather parameters again in the backward (FSDP's default; less
        memory) instead of keeping the forward's gathered copies; "auto": the planner chooses
        (parallel/auto/resharding.py) and the plan's choice runs;
    bucket: one flat collective per block and placement group for parameter gathers and
        gradient reductions (instead of one per tensor);
    reduce_bucket_bytes: gradient buckets of consecutive blocks are joined until one holds
        this many bytes (DDP's `bucket_cap_mb` rule, the same 25 MiB default; 0: one bucket
        per block): blocks smaller than that share a collective;
    overlap: start collectives early and wait for them at first use (step graph);
    compile / compile_fallback / compile_mode: Inductor-compile the step graph (mode as
        torch.compile's: "default", "max-autotune" benchmarks GEMM kernels); on a compile
        error run it eagerly (with a warning) instead of failing;
    load_balance: the inputs' sequence follows the load-balanced context-parallel order for
        this many ranks (parallel/recipes/cp.py; 1 = natural order): local_map regions that
        depend on positions (causal attention) read it;
    micro_batches: forward/backward passes per optimizer step (gradient accumulation): more
        than one runs the step graph without its gradient reductions and reduces the summed
        gradients once per step, so the memory estimate counts that sum (held between
        micro-batches: for Partial gradients, a whole unreduced gradient per rank).
    """

    ac_mode: str = "none"
    ac_option: str = "op"
    ac_blocks: tuple[str, ...] | None = None
    reshard_after_forward: bool | str = True
    bucket: bool = True
    reduce_bucket_bytes: int = 25 * 2**20
    overlap: bool = True
    compile: bool = False
    compile_fallback: bool = False
    compile_mode: str = "default"
    load_balance: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches {self.micro_batches!r}: use a whole number >= 1")
        if not isinstance(self.reduce_bucket_bytes, int) or self.reduce_bucket_bytes < 0:
            raise ValueError(f"reduce_bucket_bytes {self.reduce_bucket_bytes!r}: use a whole number of bytes >= 0")
        if self.reshard_after_forward not in (True, False, "auto"):
            raise ValueError(f"reshard_after_forward {self.reshard_after_forward!r}: use true, false or \"auto\"")
        if self.ac_mode not in AC_MODES:
            raise ValueError(f"activation checkpointing mode {self.ac_mode!r}: use one of {', '.join(AC_MODES)}")
        opt = str(self.ac_option)
        if self.ac_mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ValueError(f"selective activation checkpointing option {opt!r}: use 'op' or a positive integer N")
        if self.ac_blocks is not None:
            if isinstance(self.ac_blocks, str) or not all(isinstance(c, str) for c in self.ac_blocks):
                raise ValueError(f"ac_blocks {self.ac_blocks!r}: use a tuple of {', '.join(AC_CHOICES)}, "
                                 "one per transformer block")
            object.__setattr__(self, "ac_blocks", tuple(self.ac_blocks))  # a list (JSON, TOML) is kept as a tuple
            bad = sorted({c for c in self.ac_blocks if c not in AC_CHOICES})
            if bad:
                raise ValueError(f"ac_blocks {self.ac_blocks!r}: {', '.join(map(repr, bad))} is not an activation "
                                 f"checkpointing choice; use one of {', '.join(AC_CHOICES)} per block")

    def ac_policies(self, n_blocks: int) -> tuple[str, ...]:
        """Each of the model's `n_blocks` blocks' `AC_CHOICES` entry: `ac_blocks`, else ac_mode /
        ac_option's (`block_policies`)."""
        if self.ac_blocks is None:
            return block_policies(self.ac_mode, self.ac_option, n_blocks)
        if len(self.ac_blocks) != n_blocks:
            raise ValueError(f"ac_blocks has {len(self.ac_blocks)} choices but the model has {n_blocks} "
                             "transformer blocks: give one choice per block")
        return self.ac_blocks

    @property
    def ac_label(self) -> str:
        """The checkpointing in words: "none", "full", "selective op", "selective 2", or per block
        ("per block: full, op")."""
        if self.ac_blocks is not None:
            return f"per block: {', '.join(self.ac_blocks)}" if self.ac_blocks else "none"
        return self.ac_mode if self.ac_mode != "selective" else f"selective {self.ac_option}"

    @property
    def ac_level(self) -> str:
        """The ac_mode equivalent ("none", "selective", "full") of the checkpointing in use, for
        advice on what lowers the peak."""
        if self.ac_blocks is None:
            return self.ac_mode
        used = set(self.ac_blocks)
        return "none" if used <= {"none"} else "full" if used == {"full"} else "selective"
