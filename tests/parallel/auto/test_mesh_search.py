"""Mesh enumeration (layout rules on nodes of 8) and ranking of planned meshes."""

import pytest

from parallel.auto.search.mesh_space import (
    MeshOption,
    MeshSearchError,
    MeshSpec,
    enumerate_meshes,
    parse_mesh,
    rank_mesh_options,
)


def labels(world, gpn=8, **kw):
    return sorted(m.label for m in enumerate_meshes(world, gpn, **kw))


def test_eight_devices_on_one_node():
    assert labels(8) == sorted([
        "dp_shard=8", "dp_shard=4,tp=2", "dp_shard=2,tp=4", "tp=8",
        "dp_replicate=2,dp_shard=4", "dp_replicate=4,dp_shard=2", "dp_replicate=2,dp_shard=2,tp=2",
    ])


def test_thirty_two_devices_on_four_nodes():
    meshes = enumerate_meshes(32, 8)
    assert len(meshes) == 11
    assert all(m.world == 32 for m in meshes)
    assert all(m.degree("tp") in (1, 2, 4, 8) for m in meshes)  # tensor parallel inside a node
    for m in meshes:  # the replicate axis runs between whole nodes
        if m.degree("dp_replicate") > 1:
            assert (32 // m.degree("dp_replicate")) % 8 == 0 and m.degree("dp_shard") > 1
    assert "dp_replicate=2,dp_shard=2,tp=8" in {m.label for m in meshes}
    assert "dp_replicate=8,dp_shard=4" not in {m.label for m in meshes}  # replicate would split a node
    assert "cp" not in " ".join(m.label for m in meshes)


def test_cp_only_when_asked():
    with_cp = labels(8, axes=("dp_shard", "cp", "tp"))
    assert "dp_shard=2,cp=2,tp=2" in with_cp and "cp=8" in with_cp


def test_world_that_no_layout_serves():
    with pytest.raises(MeshSearchError, match="world size 12 is not a whole number of nodes of 8"):
        enumerate_meshes(12, 8)
    # 6 ranks inside one node: any layout, tp dividing the node
    assert labels(6) == sorted(["dp_shard=6", "dp_shard=3,tp=2", "dp_replicate=3,dp_shard=2",
                                "dp_replicate=2,dp_shard=3"])


def test_parse_mesh_forms_and_errors():
    assert parse_mesh("4x8") == MeshSpec((4, 8), ("dp_shard", "tp"))
    assert parse_mesh("dp_replicate=2,dp_shard=1,tp=8") == MeshSpec((2, 8), ("dp_replicate", "tp"))
    assert parse_mesh("2x4x8").names == ("dp_replicate", "dp_shard", "tp")
    assert parse_mesh("tp=4").data_axes() == []  # the loader feeds one replicated batch
    with pytest.raises(MeshSearchError, match="'4y8' is not a mesh"):
        parse_mesh("4y8")
    with pytest.raises(MeshSearchError, match="distinct names"):
        parse_mesh("dp=4,tp=8")
    # a caller's own axis names: one per axis, or a table by number of axes (tools/plan.py's "dp")
    assert parse_mesh("2x1x4", ("dp", "cp", "tp")) == MeshSpec((2, 4), ("dp", "tp"))
    assert parse_mesh("8", {1: ("dp",)}) == MeshSpec((8,), ("dp",))
    with pytest.raises(MeshSearchError, match="one distinct name per axis"):
        parse_mesh("2x4", ("dp",))


def test_rank_fitting_by_step_time_then_dropped():
    a, b, c, d = (MeshSpec((n,), ("dp_shard",)) for n in (1, 2, 3, 4))
    ranked = rank_mesh_options([MeshOption(a, 30.0, True), MeshOption(b, 10.0, False, "OOM"),
                              MeshOption(c, 20.0, True), MeshOption(d, None, False, "no plan")])
    assert [x.mesh for x in ranked] == [c, a, b, d]
    # per token: a mesh stepping over twice the tokens in 1.5x the time is faster
    big = MeshOption(b, 30.0, True, tokens=2)
    assert [x.mesh for x in rank_mesh_options([MeshOption(a, 20.0, True), big])] == [b, a]
