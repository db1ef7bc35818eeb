"""Hardware profiles: the numbers the cost model turns shapes and bytes into microseconds.

A profile is plain data read from a TOML file (``configs/hardware/<name>.toml``), so
picking "h100" on a CPU-only machine never touches a GPU, and a user can pass their own
file (or a :class:`HardwareProfile` object) to plan for hardware we do not ship.

Units inside the TOML are the ones people quote: TFLOP/s, GB/s (1e9 bytes/s), GiB, µs.
Everything is validated on load; an unknown or missing key is an error naming the file
and the key, because a silently ignored typo would silently change every plan.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as _toml  # type: ignore[no-redef]

import torch

__all__ = [
    "AUTO",
    "DEFAULT_HARDWARE",
    "COLLECTIVE_KINDS",
    "HardwareProfile",
    "InterNodeLink",
    "IntraNodeLink",
    "ProfileError",
    "hardware_dir",
    "list_profiles",
    "load_hardware",
    "profile_from_dict",
    "profile_to_toml",
    "dtype_key",
]

#: the collectives a redistribution can need, in the names NCCL / nccl-tests use
COLLECTIVE_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

# peak-table keys and the torch dtypes they cover
_DTYPE_KEYS: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_KEYS[getattr(torch, _name)] = "fp8"
# what a missing entry falls back to (fp8 runs at least as fast as bf16, etc.)
_PEAK_FALLBACK = {"fp8": "bf16", "fp16": "bf16", "bf16": "fp32", "tf32": "fp32", "fp64": "fp32"}
_PEAK_KEYS = ("bf16", "fp16", "fp32", "fp8", "tf32", "fp64")


DEFAULT_HARDWARE = "auto"
"""The profile used when none is named: the trainer's `[parallelism] hardware` and
`[metrics] hardware`, the API and the scripts all read this one. "auto": this machine,
measured for the job's world size (cost/calibrate.py; a GPU's shipped profile when its
name is known)."""
AUTO = "auto"


class ProfileError(ValueError):
    """A hardware profile could not be found or is malformed (message names file and key)."""


@dataclass(frozen=True)
class IntraNodeLink:
    """Links between devices of one node (NVLink/NVSwitch, or loopback for gloo).

    ``bus_bandwidth_gbps`` is NCCL-tests *bus* bandwidth per collective kind, so that
    t = latency + S·(n−1)/n / busBW holds for all-gather/reduce-scatter.
    Latency is ``latency_us`` (fixed per collective: launch + sync) plus
    ``hop_latency_us`` per algorithm step (n−1 steps for a ring).
    """

    bus_bandwidth_gbps: Mapping[str, float]
    latency_us: float
    hop_latency_us: float
    #: bus bandwidth multiplier for small groups ({2: 1.35, 4: 1.15}): NVSwitch rings of
    #: few GPUs reach more than at full node size. A group of n uses the entry of the
    #: smallest listed size >= n, or 1.0 when n exceeds them all.
    group_size_factor: Mapping[int, float] = field(default_factory=dict)

    def bandwidth(self, kind: str, group_size: int) -> float:
        """Bus bandwidth (GB/s) of ``kind`` for a group of ``group_size`` devices."""
        bigger = [k for k in self.group_size_factor if k >= group_size]
        f = self.group_size_factor[min(bigger)] if bigger else 1.0
        return self.bus_bandwidth_gbps[kind] * f


@dataclass(frozen=True)
class InterNodeLink:
    """Network between nodes: one NIC per device (rail-optimised), each way bandwidth."""

    bandwidth_gbps: float
    latency_us: float
    hop_latency_us: float


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device figures of one machine type.

    Why each field exists:
      * ``peak_tflops`` per dtype + ``matmul_efficiency``: the compute roof of the roofline.
      * ``memory_bandwidth_gbps`` + ``memory_efficiency``: the memory roof.
      * ``attention_efficiency``: a fused attention kernel (flash, memory-efficient, the CPU
        flash kernel) reaches its own fraction of the compute roof, below a big GEMM's
        (0: ``matmul_efficiency``).
      * ``attention_grid``: a calibrated profile's ``[attention_efficiency]`` table, the CPU
        flash kernel's efficiency per direction, head dim and sequence length (keys
        ``fwd_d32_s128``; cost/calibrate_attention.py): its speed varies ~2x over the shapes
        jobs run and its backward is slower than its forward; a shape is priced at the
        nearest grid point (`attention_eff_for`). Empty (named profiles): the single figure.
      * ``kernel_floor_us``: many tiny kernels are launch-bound, not roof-bound.
      * ``gpus_per_node``: decides which mesh axes ride NVLink and which the NIC.
      * ``tree_bandwidth_factor``: tree all-reduce reaches this fraction of the ring's
        bus bandwidth (it wins on latency for small messages on many nodes, loses on
        bandwidth for large ones).
      * ``memory_limit_bytes``: what the planner lets a plan's predicted peak per device
        reach (TOML ``memory_limit_gib``; unset: all of ``memory_gib``); a plan over it is
        re-solved more sharded, or refused.
      * ``comm_overlap``: the share of a collective's time that runs beside compute (1 on
        GPUs, whose copy engines and NICs move the bytes; lower on CPUs, whose cores also
        drive gloo). The runtime overlaps collectives; the cost model prices what stays.
      * ``op_bandwidth_gbps``: a calibrated profile's bandwidth per class of memory-bound op
        (elementwise, transcendental, reduction, cat; cost/calibrate_ops.py): a training step's
        such ops run below the copy roof (fresh outputs, activations out of cache); a class
        without a figure (every named profile) is priced at the memory roof.
      * ``optimizer``: a calibrated profile's measured optimizer phase (AdamW and gradient
        clipping): ``gbps``, local fp32 parameter bytes stepped per second, and ``tensor_us``
        per parameter tensor, of the foreach AdamW, and ``fused_gbps``, ``fused_tensor_us`` of
        the fused one (`[optimizer] implementation = "fused"`); empty (named profiles):
        memory-bound passes at the memory roof.
      * ``correction``: a calibrated (`hardware = "auto"`) profile's ``step_time_ratio``, a
        job's measured step over the predicted one when they differed by more than 25 %, and
        where it came from (cost/correction.py); the step simulation multiplies by it.
    """

    name: str
    gpus_per_node: int
    peak_tflops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_gbps: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_floor_us: float
    intra_node: IntraNodeLink
    inter_node: InterNodeLink
    tree_bandwidth_factor: float = 0.45
    comm_overlap: float = 1.0
    attention_efficiency: float = 0.0  # 0: matmul_efficiency
    memory_limit_bytes: int = 0  # 0: memory_bytes
    description: str = ""
    source: str = field(default="<dict>", compare=False)
    correction: Mapping[str, Any] = field(default_factory=dict)
    op_bandwidth_gbps: Mapping[str, float] = field(default_factory=dict)
    optimizer: Mapping[str, float] = field(default_factory=dict)
    attention_grid: Mapping[str, float] = field(default_factory=dict)
    # this job's share of its host, measured when it started (cost/contention.py; never saved):
    # other work holding cores slows every rank's step by this factor (1: a quiet host)
    contention: float = field(default=1.0, compare=False)

    # ------------------------------------------------------------------ queries
    def peak_flops(self, dtype: torch.dtype | str | None) -> float:
        """Peak FLOP/s (not TFLOP/s) for a dtype; missing entries fall back (fp8→bf16→fp32)."""
        key = dtype_key(dtype)
        seen = set()
        while key not in self.peak_tflops:
            seen.add(key)
            key = _PEAK_FALLBACK.get(key, "fp32")
            if key in seen:  # pragma: no cover - fp32 is required, so unreachable
                break
        return float(self.peak_tflops[key]) * 1e12

    @property
    def attention_eff(self) -> float:
        """The fraction of the compute roof a fused attention kernel reaches."""
        return self.attention_efficiency or self.matmul_efficiency

    def attention_eff_for(self, backward: bool, head_dim: int, seq: int) -> float:
        """The efficiency of a fused attention kernel of `head_dim` and `seq` (the query's
        length): the measured grid point nearest in log space (head dim first), else
        `attention_eff`."""
        want = "bwd" if backward else "fwd"
        best, eff = None, 0.0
        for key, value in self.attention_grid.items():
            direction, d, s = _attention_key(key)
            if direction != want:
                continue
            dist = (abs(math.log2(d / max(head_dim, 1))) * 4 + abs(math.log2(s / max(seq, 1))), d, s)
            if best is None or dist < best:
                best, eff = dist, value
        return eff or self.attention_eff

    def op_bandwidth(self, op_class: str | None) -> float:
        """Bytes/s a memory-bound op of `op_class` moves (compute.op_class): the calibrated
        figure, else the memory roof."""
        gbps = self.op_bandwidth_gbps.get(op_class) if op_class else None
        return gbps * 1e9 if gbps else self.memory_bandwidth * self.memory_efficiency

    @property
    def memory_limit(self) -> int:
        """Bytes a plan's peak per device may reach (the memory limit, else all the memory)."""
        return self.memory_limit_bytes or self.memory_bytes

    @property
    def memory_bandwidth(self) -> float:
        """Bytes/s."""
        return self.memory_bandwidth_gbps * 1e9

    def replace(self, **changes: Any) -> HardwareProfile:
        """A copy with some fields changed (e.g. a calibrated efficiency)."""
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line for logs and plan reports."""
        ib = self.intra_node.bus_bandwidth_gbps
        return (
            f"{self.name}: {self.gpus_per_node}/node, bf16 {self.peak_tflops.get('bf16', 0):g} / "
            f"fp32 {self.peak_tflops['fp32']:g} TFLOP/s, mem {self.memory_bytes / 2**30:.0f} GiB @ "
            f"{self.memory_bandwidth_gbps:g} GB/s, intra AG {ib['all_gather']:g} AR {ib['all_reduce']:g} GB/s "
            f"({self.intra_node.latency_us:g} µs), inter {self.inter_node.bandwidth_gbps:g} GB/s "
            f"({self.inter_node.latency_us:g} µs)"
        )


def dtype_key(dtype: torch.dtype | str | None) -> str:
    """Map a torch dtype (or 'bf16'-style string) to a peak-table key; ints/bools → fp32."""
    if dtype is None:
        return "fp32"
    if isinstance(dtype, str):
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                   "float": "fp32", "float64": "fp64", "double": "fp64", "float8": "fp8"}
        return aliases.get(dtype, dtype)
    return _DTYPE_KEYS.get(dtype, "fp32")


# ---------------------------------------------------------------------- loading
def hardware_dir() -> Path:
    """Folder of the shipped profiles (``configs/hardware`` at the repo root).

    ``AUTOTITAN_HARDWARE_DIR`` overrides it (e.g. for an installed package).
    """
    env = os.environ.get("AUTOTITAN_HARDWARE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "configs" / "hardware"


def list_profiles() -> list[str]:
    """Names of the shipped profiles."""
    d = hardware_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def load_hardware(profile: str | os.PathLike[str] | HardwareProfile) -> HardwareProfile:
    """Resolve a profile: a HardwareProfile passes through; a name means
    ``configs/hardware/<name>.toml``; anything with a path separator or ``.toml`` is a file.
    """
    if isinstance(profile, HardwareProfile):
        return profile
    text = os.fspath(profile)
    looks_like_path = text.endswith(".toml") or os.sep in text or "/" in text
    path = Path(text) if looks_like_path else hardware_dir() / f"{text}.toml"
    if not path.is_file():
        if looks_like_path:
            raise ProfileError(f"hardware profile file not found: {path}")
        raise ProfileError(
            f"unknown hardware profile {text!r}; available: {', '.join(list_profiles()) or '(none)'}"
            f" (in {hardware_dir()}), or pass a path to a .toml file"
        )
    try:
        with open(path, "rb") as f:
            data = _toml.load(f)
    except _toml.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from e
    return profile_from_dict(data, source=str(path))


_TOP_KEYS = {
    "name": True, "description": False, "gpus_per_node": True, "memory_gib": True, "memory_limit_gib": False,
    "memory_bandwidth_gbps": True, "kernel_floor_us": True, "peak_tflops": True,
    "efficiency": True, "intra_node": True, "inter_node": True, "collectives": False,
    "calibration": False, "correction": False, "op_bandwidth_gbps": False, "optimizer": False,
    "attention_efficiency": False,
}


def _check_keys(d: Mapping[str, Any], allowed: Mapping[str, bool], where: str, source: str) -> None:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{source}: [{where}] must be a table, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            raise ProfileError(
                f"{source}: unknown key {k!r} in [{where or 'top level'}]; allowed: {', '.join(sorted(allowed))}"
            )
    for k, required in allowed.items():
        if required and k not in d:
            raise ProfileError(f"{source}: missing required key {k!r} in [{where or 'top level'}]")


def _num(d: Mapping[str, Any], key: str, where: str, source: str, *, positive: bool = True,
         at_most: float | None = None) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{source}: {where}{key} = {v!r} must be a finite number")
    if positive and v <= 0:
        raise ProfileError(f"{source}: {where}{key} = {v!r} must be > 0")
    if not positive and v < 0:
        raise ProfileError(f"{source}: {where}{key} = {v!r} must be >= 0")
    if at_most is not None and v > at_most:
        raise ProfileError(f"{source}: {where}{key} = {v!r} must be <= {at_most}")
    return float(v)


def _name_and_size(data: Mapping[str, Any], source: str) -> tuple[str, int]:
    """The profile's name and devices per node, both checked."""
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{source}: name = {name!r} must be a non-empty string")
    gpn = data["gpus_per_node"]
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ProfileError(f"{source}: gpus_per_node = {gpn!r} must be an integer >= 1")
    return name, gpn


def _peak_table(data: Mapping[str, Any], source: str) -> dict[str, float]:
    """[peak_tflops]: fp32 required, the other dtypes optional (they fall back)."""
    peaks = data["peak_tflops"]
    _check_keys(peaks, {k: k == "fp32" for k in _PEAK_KEYS}, "peak_tflops", source)
    return {k: _num(peaks, k, "peak_tflops.", source) for k in peaks}


def _efficiencies(data: Mapping[str, Any], source: str) -> tuple[float, float, float]:
    """[efficiency]: (matmul, memory, attention), each a fraction of its roof (attention
    optional: 0, the matmul figure)."""
    eff = data["efficiency"]
    _check_keys(eff, {"matmul": True, "memory": True, "attention": False}, "efficiency", source)
    matmul = _num(eff, "matmul", "efficiency.", source, at_most=1.0)
    memory = _num(eff, "memory", "efficiency.", source, at_most=1.0)
    attention = _num(eff, "attention", "efficiency.", source, at_most=1.0) if "attention" in eff else 0.0
    return matmul, memory, attention


def _group_size_factor(intra: Mapping[str, Any], source: str) -> dict[int, float]:
    """[intra_node.group_size_factor]: bandwidth multipliers keyed by group size (>= 2)."""
    gsf_raw = intra.get("group_size_factor", {})
    if not isinstance(gsf_raw, Mapping):
        raise ProfileError(f"{source}: [intra_node.group_size_factor] must be a table like {{2 = 1.35}}")
    gsf: dict[int, float] = {}
    for k in gsf_raw:
        if not str(k).isdigit() or int(k) < 2:
            raise ProfileError(f"{source}: intra_node.group_size_factor key {k!r} must be a group size >= 2")
        gsf[int(k)] = _num(gsf_raw, k, "intra_node.group_size_factor.", source)
    return gsf


def _intra_link(data: Mapping[str, Any], source: str) -> IntraNodeLink:
    """[intra_node]: bus bandwidth (one number, or one per collective kind), latencies, group sizes."""
    intra = data["intra_node"]
    _check_keys(intra, {"bus_bandwidth_gbps": True, "latency_us": True, "hop_latency_us": True,
                        "group_size_factor": False}, "intra_node", source)
    gsf = _group_size_factor(intra, source)
    bw = intra["bus_bandwidth_gbps"]
    if isinstance(bw, (int, float)) and not isinstance(bw, bool):
        bw_map = {k: _num(intra, "bus_bandwidth_gbps", "intra_node.", source) for k in COLLECTIVE_KINDS}
    else:
        _check_keys(bw, {k: True for k in COLLECTIVE_KINDS}, "intra_node.bus_bandwidth_gbps", source)
        bw_map = {k: _num(bw, k, "intra_node.bus_bandwidth_gbps.", source) for k in COLLECTIVE_KINDS}
    return IntraNodeLink(
        bus_bandwidth_gbps=bw_map,
        latency_us=_num(intra, "latency_us", "intra_node.", source, positive=False),
        hop_latency_us=_num(intra, "hop_latency_us", "intra_node.", source, positive=False),
        group_size_factor=gsf,
    )


def _inter_link(data: Mapping[str, Any], source: str) -> InterNodeLink:
    """[inter_node]: per-device NIC bandwidth and latencies."""
    inter = data["inter_node"]
    _check_keys(inter, {"bandwidth_gbps": True, "latency_us": True, "hop_latency_us": True},
                "inter_node", source)
    return InterNodeLink(
        bandwidth_gbps=_num(inter, "bandwidth_gbps", "inter_node.", source),
        latency_us=_num(inter, "latency_us", "inter_node.", source, positive=False),
        hop_latency_us=_num(inter, "hop_latency_us", "inter_node.", source, positive=False),
    )


def _collective_figures(data: Mapping[str, Any], source: str) -> tuple[float, float]:
    """[collectives] (tree_bandwidth_factor, comm_overlap): 0.45 and 1.0 when absent."""
    coll = data.get("collectives", {})
    _check_keys(coll, {"tree_bandwidth_factor": False, "comm_overlap": False}, "collectives", source)
    tree = _num(coll, "tree_bandwidth_factor", "collectives.", source, at_most=1.0) \
        if "tree_bandwidth_factor" in coll else 0.45
    overlap = _num(coll, "comm_overlap", "collectives.", source, positive=False, at_most=1.0) \
        if "comm_overlap" in coll else 1.0
    return tree, overlap


def _description(data: Mapping[str, Any], source: str) -> str:
    """The free-form parts: [calibration] notes (checked to be a table) and the description."""
    if "calibration" in data and not isinstance(data["calibration"], Mapping):
        raise ProfileError(f"{source}: [calibration] must be a table (free-form notes)")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise ProfileError(f"{source}: description must be a string")
    return desc


def _correction(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """[correction]: step_time_ratio (> 0) and its provenance (free-form scalars); {} when absent."""
    corr = data.get("correction", {})
    if not isinstance(corr, Mapping):
        raise ProfileError(f"{source}: [correction] must be a table")
    if not corr:
        return {}
    if "step_time_ratio" not in corr:
        raise ProfileError(f"{source}: missing required key 'step_time_ratio' in [correction]")
    _num(corr, "step_time_ratio", "correction.", source)
    return dict(corr)


OP_BANDWIDTH_KEYS = ("elementwise", "transcendental", "reduction", "cat")
OPTIMIZER_KEYS = ("gbps", "tensor_us")
FUSED_OPTIMIZER_KEYS = ("fused_gbps", "fused_tensor_us")  # the fused AdamW's, beside foreach's (optional)


def _measured_tables(data: Mapping[str, Any], source: str) -> tuple[dict[str, float], dict[str, float]]:
    """[op_bandwidth_gbps] (any of OP_BANDWIDTH_KEYS, > 0) and [optimizer] (gbps > 0 and
    tensor_us >= 0, both or neither; fused_gbps and fused_tensor_us beside them, both or
    neither): a calibrated profile's; {} when absent."""
    ops = data.get("op_bandwidth_gbps", {})
    _check_keys(ops, {k: False for k in OP_BANDWIDTH_KEYS}, "op_bandwidth_gbps", source)
    opt = data.get("optimizer", {})
    fused = any(k in opt for k in FUSED_OPTIMIZER_KEYS)
    _check_keys(opt, {**{k: bool(opt) for k in OPTIMIZER_KEYS}, **{k: fused for k in FUSED_OPTIMIZER_KEYS}},
                "optimizer", source)
    return ({k: _num(ops, k, "op_bandwidth_gbps.", source) for k in ops},
            {k: _num(opt, k, "optimizer.", source, positive=k.endswith("gbps")) for k in opt})


_ATTENTION_KEY = re.compile(r"(fwd|bwd)_d([1-9][0-9]*)_s([1-9][0-9]*)")


def _attention_key(key: str) -> tuple[str, int, int]:
    """("fwd" | "bwd", head dim, sequence length) of an [attention_efficiency] key."""
    m = _ATTENTION_KEY.fullmatch(key)
    if m is None:
        raise ProfileError(f"[attention_efficiency] key {key!r} is not like 'fwd_d64_s512' or 'bwd_d32_s128'")
    return m.group(1), int(m.group(2)), int(m.group(3))


def _attention_grid(data: Mapping[str, Any], source: str) -> dict[str, float]:
    """[attention_efficiency]: keys `_attention_key`, each a fraction (> 0, at most 4: a causal
    kernel's halved count may beat the matmul roof) of the fp32 compute roof; {} when absent."""
    grid = data.get("attention_efficiency", {})
    if not isinstance(grid, Mapping):
        raise ProfileError(f"{source}: [attention_efficiency] must be a table, got {type(grid).__name__}")
    for key in grid:
        try:
            _attention_key(key)
        except ProfileError as e:
            raise ProfileError(f"{source}: {e}") from None
    return {k: _num(grid, k, "attention_efficiency.", source, at_most=4.0) for k in grid}


def _memory_limit(data: Mapping[str, Any], source: str) -> int:
    """memory_limit_gib: optional, positive, at most memory_gib; 0 when unset (all the memory)."""
    if "memory_limit_gib" not in data:
        return 0
    limit = _num(data, "memory_limit_gib", "", source)
    if limit > _num(data, "memory_gib", "", source):
        raise ProfileError(f"{source}: memory_limit_gib = {data['memory_limit_gib']} exceeds memory_gib = "
                           f"{data['memory_gib']}; the limit is the share of the device's memory a plan may fill")
    return int(limit * 2**30)


def profile_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Validate the TOML layout (see configs/hardware/h100.toml) and build a profile."""
    _check_keys(data, _TOP_KEYS, "", source)
    name, gpn = _name_and_size(data, source)
    peak = _peak_table(data, source)
    mm_eff, mem_eff, att_eff = _efficiencies(data, source)
    intra_link = _intra_link(data, source)
    inter_link = _inter_link(data, source)
    tree_f, overlap = _collective_figures(data, source)
    desc = _description(data, source)
    op_bw, opt = _measured_tables(data, source)
    return HardwareProfile(
        name=name,
        gpus_per_node=gpn,
        peak_tflops=peak,
        memory_bytes=int(_num(data, "memory_gib", "", source) * 2**30),
        memory_limit_bytes=_memory_limit(data, source),
        memory_bandwidth_gbps=_num(data, "memory_bandwidth_gbps", "", source),
        matmul_efficiency=mm_eff,
        memory_efficiency=mem_eff,
        attention_efficiency=att_eff,
        kernel_floor_us=_num(data, "kernel_floor_us", "", source, positive=False),
        intra_node=intra_link,
        inter_node=inter_link,
        tree_bandwidth_factor=tree_f,
        comm_overlap=overlap,
        description=desc,
        source=source,
        correction=_correction(data, source),
        op_bandwidth_gbps=op_bw,
        optimizer=opt,
        attention_grid=_attention_grid(data, source),
    )


def profile_to_toml(hw: HardwareProfile) -> str:
    """Serialise a profile back to the TOML layout (used by scripts/calibrate.py)."""
    ib = hw.intra_node.bus_bandwidth_gbps
    gsf = hw.intra_node.group_size_factor
    lines = [
        f'name = "{hw.name}"',
        f'description = "{hw.description}"',
        f"gpus_per_node = {hw.gpus_per_node}",
        f"memory_gib = {hw.memory_bytes / 2**30:.6g}",
        *([f"memory_limit_gib = {hw.memory_limit_bytes / 2**30:.6g}"] if hw.memory_limit_bytes else []),
        f"memory_bandwidth_gbps = {hw.memory_bandwidth_gbps:.6g}",
        f"kernel_floor_us = {hw.kernel_floor_us:.6g}",
        "",
        "[peak_tflops]",
        *[f"{k} = {v:.6g}" for k, v in hw.peak_tflops.items()],
        "",
        "[efficiency]",
        f"matmul = {hw.matmul_efficiency:.6g}",
        f"memory = {hw.memory_efficiency:.6g}",
        *([f"attention = {hw.attention_efficiency:.6g}"] if hw.attention_efficiency else []),
        "",
        "[intra_node]",
        f"latency_us = {hw.intra_node.latency_us:.6g}",
        f"hop_latency_us = {hw.intra_node.hop_latency_us:.6g}",
        "[intra_node.bus_bandwidth_gbps]",
        *[f"{k} = {ib[k]:.6g}" for k in COLLECTIVE_KINDS],
        *(["[intra_node.group_size_factor]"] + [f"{k} = {v:.6g}" for k, v in sorted(gsf.items())] if gsf else []),
        "",
        "[inter_node]",
        f"bandwidth_gbps = {hw.inter_node.bandwidth_gbps:.6g}",
        f"latency_us = {hw.inter_node.latency_us:.6g}",
        f"hop_latency_us = {hw.inter_node.hop_latency_us:.6g}",
        "",
        "[collectives]",
        f"tree_bandwidth_factor = {hw.tree_bandwidth_factor:.6g}",
        f"comm_overlap = {hw.comm_overlap:.6g}",
        "",
        *_table_lines("op_bandwidth_gbps", hw.op_bandwidth_gbps),
        *_table_lines("optimizer", hw.optimizer),
        *_table_lines("attention_efficiency", hw.attention_grid),
        *_correction_lines(hw.correction),
    ]
    return "\n".join(lines)


def _table_lines(name: str, table: Mapping[str, float]) -> list[str]:
    """A table of numbers (none when it is empty)."""
    return [f"[{name}]", *[f"{k} = {v:.6g}" for k, v in table.items()], ""] if table else []


def _correction_lines(corr: Mapping[str, Any]) -> list[str]:
    """The [correction] table (none when there is no correction); strings as JSON, which TOML reads."""
    if not corr:
        return []
    return ["[correction]", *[f"{k} = {json.dumps(v) if isinstance(v, str) else f'{v:.6g}'}" for k, v in corr.items()],
            ""]
