"""The one exception type of the data layer."""

from __future__ import annotations


class DataError(RuntimeError):
    """A corpus, archive, cache or token array is missing, corrupt or inconsistent.

    The message always names the offending file or setting and says what to do about it
    (which command to run, which environment variable or config field to set).
    """


class DataNotFoundError(DataError):
    """A corpus is not present in any searched location (the message says how to get it)."""
