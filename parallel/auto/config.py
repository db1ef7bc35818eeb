"""The planner's settings, one object passed whole from every entry point.

    planner = PlannerConfig(hardware="h100", split_seeding_rounds=2, memory_limit_gib=70)
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=planner) as autop: ...

The trainer fills it from `[parallelism]` (its keys there are these field names) and
`[optimizer] implementation`; `scripts/plan.py`, sweeps and the mesh search take the job's
object as it is. The object is frozen: a changed setting is a checked copy (:meth:`replace`).
Each field is checked here, once (:meth:`PlannerConfig.check`); a bad value is a
:class:`parallel.settings.SettingError` naming the field, which the trainer turns into a config
error naming the file and section. The "choose for me" values (hardware "auto") are made
concrete in one place, :func:`resolve_planner` (below), which the request builder calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from parallel.auto.cost import AUTO, DEFAULT_HARDWARE, HardwareProfile
from parallel.auto.cost.calibrate import in_real_group, resolve_auto
from parallel.auto.cost.memory import OPTIMIZERS
from parallel.auto.cost.model import DEFAULT_ROUTING_IMBALANCE
from parallel.auto.solve import SOLVERS
from parallel.settings import SettingError

JOB_KEY = "job_key"
"""Field metadata: the job key (section.key) that sets this field instead of `[parallelism]`."""


@dataclass(frozen=True)
class PlannerConfig:
    """Everything the planner reads besides the model, mesh and inputs.

    hardware: the cost model's profile (a configs/hardware name, a path, or a profile);
    solver: "auto" | "ilp" | "mrf" | "highs" | "cbc"; time_limit: seconds for the ILP (per
    TRW-S run for the MRF); mrf_patience: TRW-S stops when its best decoded plan has not
    improved for this many sweeps (the mesh search's screen uses fewer); mrf_polish: after the
    MRF, re-solve the repeated blocks jointly with the rest fixed (the screen skips it); repeated_blocks:
    one decision for the repeated copies of a block;
    split_seeding / _radius / _rounds: split-dimension seeding (None: on from 3-D meshes),
    the mesh axes a seeded strategy may differ on, re-seeding rounds around the plan;
    memory_budget_low / _high: parameter bytes per device as a fraction of all (None: no
    floor / fully sharded); memory_limit_gib: the predicted peak per device may reach this
    (None: the profile's); memory_estimate: estimate each plan's peak (and check the limit);
    moe_imbalance_factor: MoE all-to-all bytes priced x this; optimizer: AdamW's
    implementation, whose temporaries the memory estimate counts.
    """

    hardware: Union[str, HardwareProfile] = DEFAULT_HARDWARE
    solver: str = "auto"
    time_limit: float = 600.0
    mrf_patience: int = 60
    mrf_polish: bool = True
    repeated_blocks: bool = True
    split_seeding: Optional[bool] = None
    split_seeding_radius: int = 2
    split_seeding_rounds: int = 1
    memory_budget_low: Optional[float] = None
    memory_budget_high: Optional[float] = None
    memory_limit_gib: Optional[float] = None
    memory_estimate: bool = True
    moe_imbalance_factor: float = DEFAULT_ROUTING_IMBALANCE
    optimizer: str = field(default="foreach", metadata={JOB_KEY: "optimizer.implementation"})

    def check(self) -> None:
        """Raise SettingError for the first field out of range."""
        for problem in _problems(self):
            raise problem

    def replace(self, **changes: Any) -> "PlannerConfig":
        """A checked copy with `changes`."""
        new = dataclasses.replace(self, **changes)
        new.check()
        return new

    def key(self) -> dict[str, Any]:
        """The settings as plain data (a plan cache key's part): a profile by its figures."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.hardware, HardwareProfile):
            from parallel.auto.cost import profile_to_toml

            d["hardware"] = profile_to_toml(self.hardware)
        return d


def planner_fields(*, job_keyed: bool = True) -> list[dataclasses.Field]:
    """The fields of PlannerConfig; `job_keyed=False`: only those set from `[parallelism]`."""
    return [f for f in dataclasses.fields(PlannerConfig) if job_keyed or JOB_KEY not in f.metadata]


def _problems(c: PlannerConfig) -> list[SettingError]:
    out = []
    if c.solver not in SOLVERS:
        out.append(SettingError("solver", c.solver, f"unknown solver; use one of {', '.join(SOLVERS)} (highs, cbc: "
                                                    "the ILP with that backend)"))
    for key in ("memory_budget_low", "memory_budget_high"):
        v = getattr(c, key)
        if v is not None and v < 0:
            out.append(SettingError(key, v, "must be >= 0 (or left unset)"))
    low, high = c.memory_budget_low, c.memory_budget_high
    if low is not None and high is not None and low > high:
        out.append(SettingError("memory_budget_low", c.memory_budget_low,
                                f"must not exceed memory_budget_high = {c.memory_budget_high}"))
    if c.memory_limit_gib is not None and (math.isnan(c.memory_limit_gib) or not c.memory_limit_gib > 0):
        out.append(SettingError("memory_limit_gib", c.memory_limit_gib,
                                "must be > 0 GiB per device (or left unset: the hardware profile's memory_limit_gib; "
                                "inf: no limit)"))
    if c.memory_limit_gib is not None and not c.memory_estimate:
        out.append(SettingError("memory_estimate", c.memory_estimate,
                                f"the memory limit (memory_limit_gib = {c.memory_limit_gib}) is checked against the "
                                "estimate: unset memory_limit_gib or set memory_estimate = true"))
    if c.split_seeding_radius < 0:
        out.append(SettingError("split_seeding_radius", c.split_seeding_radius,
                                "must be >= 0 (mesh axes a seeded strategy may change)"))
    if c.split_seeding_rounds < 1:
        out.append(SettingError("split_seeding_rounds", c.split_seeding_rounds,
                                "must be >= 1 (1: seed once, no re-seeding)"))
    if c.mrf_patience < 1:
        out.append(SettingError("mrf_patience", c.mrf_patience, "must be >= 1 TRW-S sweeps (default 60)"))
    if not c.time_limit > 0:
        out.append(SettingError("time_limit", c.time_limit, "must be > 0 seconds"))
    if not c.moe_imbalance_factor >= 1.0:
        out.append(SettingError("moe_imbalance_factor", c.moe_imbalance_factor,
                                "must be >= 1.0 (1.0: perfectly balanced routing; the busiest rank receives factor x "
                                "the mean)"))
    if c.optimizer not in OPTIMIZERS:
        out.append(SettingError("optimizer", c.optimizer, f"must be one of {', '.join(OPTIMIZERS)}"))
    return out


SIMULATED_GPU_PROFILE = "h100"
"""The profile of a simulated GPU job (the dry run's fake CUDA world) whose hardware is "auto"."""


def resolve_planner(planner: PlannerConfig, world_size: int, device_type: str | torch.device | None = None, *,
                    recalibrate: bool = False, gpu_profile: Callable[[], str | None] | None = None,
                    simulated: bool = False
                    ) -> PlannerConfig:
    """`planner` with its "choose for me" values made concrete: the one place they are
    resolved, so the plan records what was used (and `planner` itself when there is none).

    hardware = "auto", in this order:
      * `simulated` (a dry run: fake devices of the job's type, nothing to measure): the
        SIMULATED_GPU_PROFILE name ("h100") for a CUDA job, else "cpu";
      * inside a real process group: `gpu_profile()` (the shipped profile of this GPU, by its
        name, when known), else this machine measured by the group's ranks for `world_size`
        (cached; `recalibrate`: measured again), a HardwareProfile;
      * on a fake world (planning for machines elsewhere): the cached measurement for
        `world_size` when there is one, else the shipped cpu profile.

    Left as they are, because the choice depends on the traced problem, not on the job:
    solver = "auto" (the exact ILP or the MRF by the problem's size: solve.choose_solver),
    split_seeding = None (on from 3-D meshes), unset memory budgets (:func:`planning`: free
    when every rank could hold all model states, else fully sharded) and memory_limit_gib
    (the profile's).
    """
    if planner.hardware != AUTO:
        return planner
    if simulated:
        device = torch.device(device_type) if device_type is not None else torch.device("cpu")
        return planner.replace(hardware="cpu" if device.type == "cpu" else SIMULATED_GPU_PROFILE)
    shipped = gpu_profile() if gpu_profile is not None and in_real_group() else None
    if shipped is not None:
        return planner.replace(hardware=shipped)
    device = torch.device(device_type) if device_type is not None else None
    return planner.replace(hardware=resolve_auto(world_size, device, recalibrate=recalibrate))
