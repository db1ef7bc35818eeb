"""Hardware-aware cost model of the planner (paper §4.2): microseconds per op and per
redistribution, from a hardware profile that is plain data.

API (what the planner calls; a user may pass a subclass / any object with these methods)::

    from parallel.auto.cost import HardwareProfile, load_hardware, CostModel, Collective

    hw = load_hardware("h100")   # name -> configs/hardware/h100.toml; a path to a .toml;
                                 # a HardwareProfile passes through. Unknown name ->
                                 # ProfileError listing the available profiles.
    cm = CostModel(hw, mesh_shape=(4, 8), mesh_axis_names=("dp", "tp"))
                                 # pure data: never touches a GPU or a process group.
                                 # compute_dtype=torch.bfloat16 for mixed precision.

    cm.compute_cost(node_or_op, local_args_meta, flops=None) -> float
        # µs of one op on per-device (local) shapes: roofline
        #   max(FLOPs / (peak[dtype]·eff_mm), bytes / (mem_bw·eff_mem)) + kernel_floor,
        # FLOPs by FlopCounterMode on meta tensors (cached by op, shapes, dtypes, args);
        # views / reshapes / t / transpose / getitem / detach cost 0.
        # local_args_meta: the op's args, tensors as meta/fake tensors, TensorMeta or
        # (shape, dtype); keyword-only extras: local_kwargs_meta, out_meta, compute_dtype.

    cm.redistribute_cost(src, dst, tensor_meta) -> float
        # src/dst: DTensorSpec or tuple of Placements; tensor_meta: TensorMeta or
        # (global_shape, dtype), optional when the specs carry tensor_meta.
        # µs; 0 when equal; math.inf when not allowed (Replicate/Shard -> Partial).

    cm.redistribute_collectives(src, dst, tensor_meta) -> list[Collective]
        # Collective(kind: "all_gather"|"reduce_scatter"|"all_reduce"|"all_to_all"|"local",
        #            mesh_axis: int, axis_name: str, bytes: int, time_us: float, algorithm)
        # raises RedistributionNotAllowed where redistribute_cost is inf.

    cm.summarize(collectives) / summarize_collectives(...)
        # {(kind, axis_name): {"count", "bytes", "time_us"}} for the Plan's report.
    cm.collective_cost(kind, nbytes, mesh_axis), cm.links[i] (AxisLink), cm.describe(),
    cm.project(mesh_axis) (1-D model of one axis, for split-dimension seeding),
    cm.local_shape(global_shape, placements), cm.strategy_compute_cost(node, op_spec),
    CostModel.from_mesh(hw, device_mesh).

Redistribution decomposes per mesh axis like DTensor's redistribute: Shard→Replicate =
all-gather, Partial→Replicate = all-reduce, Partial→Shard = reduce-scatter,
Shard(i)→Shard(j) = all-to-all, Replicate→Shard = local chunk (free),
Replicate/Shard→Partial = not allowed, Partial(a)→Partial(b) = priced as an all-reduce.
Bytes of each step use the tensor's local size on the other axes at that moment.
Each collective is costed on its own axis's link: axes whose groups fit in a node use the
intra-node (NVLink) bus bandwidth; axes that span nodes are bounded by the NIC (see comm.py).

Profiles: configs/hardware/{h100,h200,a100,cpu}.toml; ``scripts/calibrate.py`` measures
this machine (matmul, copy, gloo collectives on 2 ranks) and writes a profile TOML.
"""
from .comm import (
    AxisLink,
    Collective,
    RedistributionNotAllowed,
    Step,
    axis_links,
    collective_time,
    decompose_redistribution,
    summarize_collectives,
)
from .compute import ZERO_COST_OPS, FlopCache, is_zero_cost, op_name, roofline_us
from .hardware import (
    AUTO,
    COLLECTIVE_KINDS,
    DEFAULT_HARDWARE,
    HardwareProfile,
    InterNodeLink,
    IntraNodeLink,
    ProfileError,
    hardware_dir,
    list_profiles,
    load_hardware,
    profile_from_dict,
    profile_to_toml,
)
from .model import CostModel, RuntimeSchedule

__all__ = [
    "AxisLink",
    "AUTO",
    "COLLECTIVE_KINDS",
    "DEFAULT_HARDWARE",
    "Collective",
    "CostModel",
    "FlopCache",
    "HardwareProfile",
    "InterNodeLink",
    "IntraNodeLink",
    "ProfileError",
    "RuntimeSchedule",
    "RedistributionNotAllowed",
    "Step",
    "ZERO_COST_OPS",
    "axis_links",
    "collective_time",
    "decompose_redistribution",
    "hardware_dir",
    "is_zero_cost",
    "list_profiles",
    "load_hardware",
    "op_name",
    "profile_from_dict",
    "profile_to_toml",
    "roofline_us",
    "summarize_collectives",
]
