"""The trainer's error types: what the user fixes in the job config (exit 2), and the faults
a job meets while it runs (exit 1): each message says what happened and what to do."""


class ConfigError(ValueError):
    """A bad job configuration (file, section.key, value and the fix are in the message)."""


class TrainingFault(RuntimeError):
    """A run stopped by what happened to it (non-finite values, a stalled rank, a failed
    save): the message names the step, the cause and what to do. `reporting_rank` prints it
    (rank 0, unless rank 0 is the one that stalled)."""

    def __init__(self, message: str, reporting_rank: int = 0) -> None:
        super().__init__(message)
        self.reporting_rank = reporting_rank
