"""The scheduler's error type (its own module so that every arbiter can raise it without
importing another)."""


class SchedulingError(RuntimeError):
    """An event that cannot happen in a correct pipeline (duplicate input, unknown task)."""
