"""The project's exceptions.

Misses are values, never exceptions. These are for what a person has to fix (configuration,
paths, permissions, space) and for contract violations by a caller. Each message names the
problem and the fix; the CLI prints it without a traceback.
"""


class HpkvError(Exception):
    """Base of every error HPKV raises on purpose."""


class ConfigError(HpkvError):
    """A configuration key has a bad value, is unknown, or comes from a place it may not."""


class PoolError(HpkvError):
    """The shared-memory pool cannot be created or mapped (space, permissions, a live owner)."""


class StorageError(HpkvError):
    """The storage directory cannot be used (permissions, not a directory)."""
