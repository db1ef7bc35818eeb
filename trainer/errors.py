"""The trainer's error type: what the user fixes in the job config."""


class ConfigError(ValueError):
    """A bad job configuration (file, section.key, value and the fix are in the message)."""
