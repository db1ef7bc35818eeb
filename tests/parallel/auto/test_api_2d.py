"""2-D fake mesh: FSDP on the inter-node dp axis + column/row tensor parallel on tp."""

import pytest
from test_api import _fwd_weight_use, _plan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from models import build_model
from parallel.auto.api import fake_world


@pytest.mark.slow
def test_fsdp_tp_emerges_on_2d_mesh():
    """Batch on the (inter-node) dp axis, column/row tensor parallel on the (NVLink) tp axis,
    for a job whose weights outweigh its activations (dim 1024, 2 x 512 tokens): there
    sharding the weights beats gathering them, even with the gathers bucketed and
    prefetched (with more tokens than that, gathering the weights on tp too wins)."""
    model = build_model("llama3", "debug", device="meta", n_layers=1, dim=1024, ffn_hidden_dim=3072, n_heads=16,
                        n_kv_heads=8)
    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp", "tp"))
        rep = (Shard(0), Replicate())
        plan = _plan(mesh, model, 2, 512, input_constraints=[rep, rep])
    roles = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w1": 1, "w3": 1, "w2": 0}
    for name, tp_dim in roles.items():
        mod = "attention" if name.startswith("w") and name in ("wq", "wk", "wv", "wo") else "feed_forward"
        w, x = _fwd_weight_use(plan, f"layers.0.{mod}.{name}.weight")
        assert w[1] == Shard(tp_dim), f"{name}: weight on tp {w}"
        assert w[0] == Replicate(), f"{name}: weight gathered on dp {w}"
        assert x[0] == Shard(0), f"{name}: batch on dp {x}"
    summary = plan.summary()
    assert ("column-parallel on tp" in summary and "row-parallel on tp" in summary
            and "FSDP (all-gather) on dp" in summary)
    assert plan.memory_fraction == pytest.approx(1 / 16)
