"""The exact minimum of a tiny pairwise MRF, by enumeration: what the solvers are checked against."""

from __future__ import annotations

import itertools

import numpy as np

from parallel.auto.solve.mrf import PairwiseMRF


def brute_force(mrf: PairwiseMRF) -> tuple[np.ndarray, float]:
    """(labels, energy) of the minimum over every assignment; only for tiny instances."""
    best, best_e = None, float("inf")
    for combo in itertools.product(*(range(mrf.num_labels(i)) for i in range(mrf.num_nodes))):
        e = mrf.energy(combo)
        if e < best_e:
            best, best_e = np.array(combo, dtype=np.int64), e
    assert best is not None
    return best, best_e
