"""Exception hierarchy shared by every kvfabric layer.

Every error the library raises on bad input or a broken invariant derives from
:class:`KVFabricError`, so callers (and later the daemon's error replies) can map
them to a stable kind without string matching. Each subclass also derives from the
closest builtin so generic handlers (``except ValueError``) keep working.
"""

from __future__ import annotations


class KVFabricError(Exception):
    """Base of every kvfabric error; ``kind`` is a stable, wire-friendly name."""

    kind = "internal"


class SpecError(KVFabricError, ValueError):
    """A KVSpec, namespace or layout argument is invalid."""

    kind = "bad_spec"


class SpecMismatchError(KVFabricError, ValueError):
    """An object exists but was stored under a different KV spec than requested."""

    kind = "spec_mismatch"


class PayloadSizeError(KVFabricError, ValueError):
    """A payload's byte length does not match what the spec and token count require."""

    kind = "bad_size"


class NotFoundError(KVFabricError, KeyError):
    """No object is stored under the key."""

    kind = "not_found"

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else "not found"


class AlreadyExistsError(KVFabricError):
    """An object with this key is already stored or being written."""

    kind = "exists"


class CapacityError(KVFabricError, MemoryError):
    """No tier can make room for the request (everything left is pinned or too small)."""

    kind = "no_capacity"


class ObjectAbortedError(KVFabricError):
    """The writer of an object aborted (or its reservation expired) before it completed."""

    kind = "aborted"


class LeaseExpiredError(KVFabricError):
    """A reservation or pin outlived its deadline and was reclaimed."""

    kind = "lease_expired"


class DeadlineExceededError(KVFabricError, TimeoutError):
    """An operation did not finish before its deadline."""

    kind = "deadline"


class CorruptRecordError(KVFabricError):
    """A stored record failed its checksum or structural checks; it is never served."""

    kind = "corrupt"


class ConfigError(KVFabricError, ValueError):
    """A configuration value is invalid (bad size, hostile path, unknown key, ...)."""

    kind = "bad_config"
