"""Our state dict under Hugging Face names for DCP's HF reader (an export splits experts through
models.hf.hf_tensor_map), the stacked routed experts (models/moe.py) as HF's one tensor per expert.

Why a planner: DCP's HF reader fills one state-dict entry from one safetensors tensor, and a
plain tensor entry means the whole of it. Each expert slice this rank holds (a view into its
shard of ``experts.w1`` etc.) becomes its own entry, and `ExpertSlicePlanner` tells DCP
which box of that expert's HF tensor the view is. So each rank reads only its experts, in
any sharding whose local part is one box of ``[E, ...]``: EP's ``Shard(0)``, FSDP's further
split of dim 0 (``_StridedShard``, still one box per rank), a planner's ``Shard(1)``.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from models.hf import hf_state_keys, to_hf_key
from models.hf_experts import expert_hf_key, is_stacked_experts

__all__ = ["has_hf_name", "hf_load_entries", "ExpertSlicePlanner"]


def has_hf_name(key: str) -> bool:
    """Whether our state-dict entry ``key`` is saved in an HF checkpoint (buffers are not)."""
    return is_stacked_experts(key) or key in hf_state_keys([key])


def _local_box(t: torch.Tensor, key: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's part of ``t``, its offsets in the full tensor); all of a plain tensor."""
    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    local = t.to_local()
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise NotImplementedError(f"{key}: this rank's shard ({t.placements}) is not one box of the full tensor; "
                                  "HF expert loading reads one box per rank")
    return local, tuple(chunks[0].offsets)


def hf_load_entries(sd: dict[str, torch.Tensor],
                    skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, ChunkStorageMetadata]]:
    """(DCP state dict under HF names, {HF name: box} of its expert slices) for filling our
    ``sd`` (plain or DTensor values) in place; ``skip``: our entries not to read."""
    entries: dict[str, torch.Tensor] = {}
    boxes: dict[str, ChunkStorageMetadata] = {}
    for k, v in sd.items():
        if k in skip or not has_hf_name(k):
            continue
        if not is_stacked_experts(k):
            entries[to_hf_key(k)] = v
            continue
        local, off = _local_box(v, k)
        box = ChunkStorageMetadata(offsets=torch.Size(off[1:]), sizes=torch.Size(local.shape[1:]))
        for j in range(local.shape[0]):
            name = expert_hf_key(k, off[0] + j)
            entries[name], boxes[name] = local[j], box
    return entries, boxes


class ExpertSlicePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that an entry named in ``boxes`` is the given box
    of its checkpoint tensor (not the whole of it): only that box is read."""

    def __init__(self, boxes: dict[str, ChunkStorageMetadata]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        rest = {k: v for k, v in self.state_dict.items() if k not in self.boxes}
        items = list(create_default_local_load_plan(rest, self.metadata).items)
        for name, box in self.boxes.items():
            if name not in md:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {name}.")
            items += create_read_items_for_chunk_list(name, md[name], [box])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.boxes:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)
