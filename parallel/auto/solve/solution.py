"""What every solver returns: one strategy index per decision group, and how it was found."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Solution:
    """One strategy index per group, with how it was obtained."""

    labels: list[int]
    objective: float
    solver: str
    status: str  # "optimal" | "time_limit" (feasible, optimality not proven)
    seconds: float
    num_vars: int
    num_constraints: int

    @property
    def optimal(self) -> bool:
        """Proven optimal (an ILP that finished); a time-limited or approximate plan is not."""
        return self.status == "optimal"
