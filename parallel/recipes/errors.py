"""The recipes' own error: a parallelism degree that does not fit the model, the batch or the mesh."""

from __future__ import annotations

__all__ = ["RecipeError"]


class RecipeError(ValueError):
    """A ``[parallelism]`` degree the recipes cannot apply. Carries the key, its value and the
    reason (which says the fix), so the trainer can report it as a config error naming its file:
    ``str(e)`` is ``'parallelism.<key>' = <value>: <reason>``."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        super().__init__(f"'parallelism.{key}' = {value!r}: {reason}")
        self.key, self.value, self.reason = key, value, reason

    def __reduce__(self) -> tuple:
        """Pickle by the three fields (spawned ranks send errors to their parent)."""
        return type(self), (self.key, self.value, self.reason)
