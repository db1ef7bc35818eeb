"""MemoryLimitError's advice: the part of the peak that dominates, and the one setting (job
TOML key and value, and the API's) that lowers that part."""

import pytest

from parallel.auto.cost.memory import GIB, MemoryEstimate
from parallel.auto.problem.feasibility import dominant_part, memory_advice


def _est(phase: str = "backward", **parts: float) -> MemoryEstimate:
    b = {k: int(parts.get(k, 0.0) * GIB) for k in ("params", "grads", "optimizer", "activations", "transient")}
    return MemoryEstimate(params_bytes=b["params"], grads_bytes=b["grads"], optimizer_bytes=b["optimizer"],
                          activations_bytes=b["activations"], transient_bytes=b["transient"],
                          peak_bytes=sum(b.values()), phase=phase)


@pytest.mark.parametrize("parts, ac, phase, name, knob", [
    (dict(params=1, optimizer=2, activations=17), "none", "backward", "activations",
     '[activation_checkpoint] mode = "selective"'),
    (dict(params=1, activations=9), "selective", "backward", "activations", '[activation_checkpoint] mode = "full"'),
    (dict(params=1, activations=9), "full", "backward", "activations", "[training] local_batch_size"),
    (dict(params=3, grads=3, optimizer=6, transient=25), "none", "backward", "transient",
     '[training] mixed_precision_param = "bfloat16"'),
    (dict(params=3, grads=6, transient=7), "none", "optimizer", "transient", '[optimizer] implementation = "fused"'),
    (dict(params=3, optimizer=6, activations=1), "none", "backward", "optimizer states",
     "[parallelism] data_parallel_shard_degree"),
])
def test_advice_names_the_dominant_part_and_its_knob(parts, ac, phase, name, knob):
    est = _est(phase, **parts)
    assert dominant_part(est)[0] == name
    text = memory_advice(est, ac_mode=ac)
    assert text.startswith(f"the largest part is {name} (") and f"in the {phase})" in text
    assert knob in text, text


def test_a_fused_optimizer_is_not_told_to_change_its_implementation():
    est = _est("optimizer", params=3, grads=6, transient=7)
    assert '"fused"' in memory_advice(est, optimizer="for-loop")
    assert "[optimizer] implementation" not in memory_advice(est, optimizer="fused")
