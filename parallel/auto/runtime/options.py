"""How a plan runs (not what it places): the runtime's knobs, one object handed down."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.settings import AC_MODES


@dataclass(frozen=True)
class RuntimeOptions:
    """Options of the ParallelModule a plan becomes.

    ac_mode / ac_option: activation checkpointing of the joint graph, as
        `[activation_checkpoint] mode` / `selective_ac_option` ("op" or every N-th block);
    reshard_after_forward: gather parameters again in the backward (FSDP's default; less
        memory) instead of keeping the forward's gathered copies;
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
    reshard_after_forward: bool = True
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
        if self.ac_mode not in AC_MODES:
            raise ValueError(f"activation checkpointing mode {self.ac_mode!r}: use one of {', '.join(AC_MODES)}")
        opt = str(self.ac_option)
        if self.ac_mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ValueError(f"selective activation checkpointing option {opt!r}: use 'op' or a positive integer N")
