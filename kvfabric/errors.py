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


class DuplicateNodeError(AlreadyExistsError):
    """Another live daemon is registered in the global index under this node id."""


class CapacityError(KVFabricError, MemoryError):
    """No tier can make room for the request (everything left is pinned or too small)."""

    kind = "no_capacity"


class QuotaExceededError(CapacityError):
    """The tenant is at one of its quotas (bytes in a tier, reservations in flight,
    namespaces) and none of its own objects can make way: the node may have room for others."""

    kind = "quota_exceeded"


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


class WouldBlockError(KVFabricError):
    """Internal: a non-blocking attempt would have to wait (the caller retries on a thread)."""

    kind = "would_block"


class ConfigError(KVFabricError, ValueError):
    """A configuration value is invalid (bad size, hostile path, unknown key, ...)."""

    kind = "bad_config"


class ProtocolError(KVFabricError, ValueError):
    """A malformed frame or request (bad msgpack, wrong types, out-of-bounds values)."""

    kind = "bad_request"


class FrameTooLargeError(ProtocolError):
    """A frame's length prefix is over the receiver's limit (refused before the body is
    read). Same kind as :class:`ProtocolError` on the wire."""


class TokenMismatchError(ProtocolError):
    """Token ids given with a chunk are not its own: not ``num_tokens`` of them, or they do
    not hash (with its parent and namespace) to its key. Same kind as :class:`ProtocolError`
    on the wire."""


class UnsupportedVersionError(ProtocolError):
    """The peer speaks a protocol version this side does not."""

    kind = "unsupported_version"


class AuthError(KVFabricError, PermissionError):
    """Missing or wrong credentials."""

    kind = "unauthorized"


class ForbiddenError(KVFabricError, PermissionError):
    """Authenticated, but not allowed to touch this namespace or operation."""

    kind = "forbidden"


class UnavailableError(KVFabricError, ConnectionError):
    """The daemon is not reachable, shutting down, or lost the session."""

    kind = "unavailable"


class UnsupportedError(KVFabricError):
    """This node cannot do that at all (no global index, no peer transport): unlike
    :class:`UnavailableError`, asking again will not help."""

    kind = "unsupported"


def _all_subclasses(cls: type[KVFabricError]) -> list[type[KVFabricError]]:
    out: list[type[KVFabricError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_for_kind(kind: str, message: str) -> KVFabricError:
    """Rebuild the exception a peer reported by its ``kind`` (unknown kinds: the base class)."""
    for cls in _all_subclasses(KVFabricError):
        if cls.kind == kind:
            return cls(message)
    error = KVFabricError(message)
    error.kind = kind
    return error
