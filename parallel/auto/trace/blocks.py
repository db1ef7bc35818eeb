"""Which transformer block (layer instance) each node of a joint graph belongs to.

The runtime buckets gathers and recomputation per block; the planner prices each block's
recomputation choice (problem/recompute.py): both read the same map.
"""

from __future__ import annotations

from parallel.auto.trace.joint import JointGraph, layer_prefix


def block_prefixes(graph: JointGraph) -> dict[str, str]:
    """node name -> the layer ('layers.3') of the transformer block it belongs to (`block_indices`)."""
    prefixes: dict[str, str] = {}
    for name, path in graph.module_of.items():
        prefix = layer_prefix(path)
        if prefix is not None:
            prefixes[name] = prefix
    for fqn, node in [*graph.params.items(), *graph.buffers.items()]:  # a layer's buffers (MoE expert bias) too
        prefix = layer_prefix(fqn)
        if prefix is not None:
            prefixes[node.name] = prefix
        else:
            prefixes.pop(node.name, None)
    return prefixes


def block_indices(graph: JointGraph) -> dict[str, int]:
    """node name -> id of the transformer block (layer instance, as the planner finds the
    repeated blocks: `problem/repeated_blocks.layer_instance`) it belongs to; parameters and buffers by their FQN,
    other nodes by the module that produced them. One id per instance: its position among
    the stack's blocks ('layers.3' -> 3 in a whole model), each further stack (a T5 decoder's 'decoder.block.i' after
    'encoder.block.i') numbered after the previous one, so blocks of the same index in two
    stacks never share a gather or reduction bucket or a recomputation graph."""
    prefixes = block_prefixes(graph)
    present: dict[str, set[int]] = {}  # stack ('encoder.block') -> the indices it holds, in order of appearance
    for prefix in prefixes.values():
        stack, idx = prefix.rsplit(".", 1)
        present.setdefault(stack, set()).add(int(idx))
    # dense ids: a pipeline stage holding layers 7-14 has blocks 0-7 (one recomputation choice each)
    offset, dense = 0, {}
    for stack, indices in present.items():
        for rank, idx in enumerate(sorted(indices)):
            dense[(stack, idx)] = offset + rank
        offset += len(indices)
    out: dict[str, int] = {}
    for name, prefix in prefixes.items():
        stack, idx = prefix.rsplit(".", 1)
        out[name] = dense[(stack, int(idx))]
    return out
