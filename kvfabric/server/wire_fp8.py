"""fp8 (e4m3) on the wire: pushed chunks of a bf16 / fp16 / fp32 namespace travel at about
half their bytes and land in the target's namespace dtype.

A chunk travels in :mod:`kvfabric.convert.fp8`'s serialized form (e4m3 values, a float32
scale per (layer, k|v, head)), within that module's error bound. Neither node's store ever
holds it in that form: both sides encode and decode through a staging buffer, a shared
arena registered with the peer transport as region :data:`STAGING_REGION` next to the host
arenas (``cluster.wire_staging_bytes``; 0: this node neither sends nor receives fp8).

Who does what, for a chunk the sender pushes as fp8 (:mod:`kvfabric.server.pusher`):

1. the sender takes staging room for the chunk's encoded bytes (none left: the chunk goes
   native) and asks ``peer_reserve`` with ``wire: "fp8"``; the target reserves the chunk as
   usual and takes staging room of its own, named in the reply's ``staging`` (none left, or
   a namespace fp8 does not apply to: no ``staging``, and the chunk goes native);
2. per batch of committed layers the sender encodes them into its staging
   (:func:`encode_layers`), writes them into the target's staging with the transport, and
   sends ``peer_commit`` with the encoded bytes' checksum (xxh3-64) per lease;
3. the target (:class:`Inbound`) checks the checksum, decodes those layers from its staging
   into the reservation's pages, and commits them: its readers wake up on native layers.
   A checksum that does not match (a scale or value changed on the way) refuses the
   commit and aborts the reservation: a damaged chunk is never readable. Staging room is
   given back when the reservation ends (complete, aborted, or its session gone).

A pull from an owner the puller's ``cluster.fp8_wire_peers`` names (:mod:`kvfabric.server.
puller`) asks ``peer_pin`` with ``wire: "fp8"``: the owner (:class:`Outbound`) encodes each
pinned chunk whole into its staging and names it, with its checksum, in the reply; the
puller reads it into its own staging, checks it and decodes it into its reservation
(:func:`land_chunk`); the owner's staging goes back with the pin.

Thread-safety: :class:`WireStaging` and :class:`Inbound` lock their own state; encoding
and decoding run on the daemon's worker threads (a commit that decodes is refused on the
event loop with WouldBlockError, which sends it to a worker).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvfabric.errors import ProtocolError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.copy import Piece, copy_pieces
from kvfabric.memory.pages import PageAllocator, Pages, slice_pages
from kvfabric.payload import PayloadReader
from kvfabric.spec import KVSpec
from kvfabric.store.handles import ObjectReader, ObjectWriter

FP8 = "fp8"
NATIVE = "native"
# Transport region id of the staging arena on every node (host arenas use small ids).
STAGING_REGION = 0xFFFF
STAGING_PAGE = 64 << 10
# An expired reservation whose writer never closed gives its staging back this much later
# (a frozen sender may still write into it until then, as into the reservation's pages).
EXPIRED_GRACE_S = 30.0


def checked_wire(value: object, default: str = NATIVE) -> str:
    """A request's ``wire`` argument (absent: ``default``); ProtocolError when it is neither
    form."""
    if value is None:
        return default
    if value not in (FP8, NATIVE):
        raise ProtocolError(f'wire must be "{FP8}" or "{NATIVE}", got {value!r}')
    return str(value)


def transfer_regions(
    host_arenas: dict[int, SharedArena], staging: WireStaging | None
) -> dict[int, SharedArena]:
    """The local regions a transfer may read or write: the host arenas by id, plus the
    staging arena (when there is one) as :data:`STAGING_REGION`."""
    regions = dict(host_arenas)
    if staging is not None:
        regions[STAGING_REGION] = staging.arena
    return regions


def wire_applies(spec: KVSpec) -> bool:
    """Whether chunks of ``spec`` may travel as fp8 (float payloads, not fp8 already)."""
    return spec.dtype.is_float


def encoded_nbytes(spec: KVSpec, num_tokens: int) -> int:
    """Bytes of a chunk in fp8 serialized form."""
    return spec.num_layers * layer_nbytes(spec, num_tokens)


def layer_nbytes(spec: KVSpec, num_tokens: int) -> int:
    from kvfabric.convert import fp8

    return fp8.serialized_nbytes((spec.kv_planes, spec.num_kv_heads, num_tokens, spec.head_dim))


@dataclass(frozen=True)
class Fp8Targets:
    """Which pushes travel as fp8 (``cluster.fp8_wire_peers``): a comma-separated list of node
    ids and hardware classes; ``*`` is every peer, empty none."""

    names: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Fp8Targets:
        return cls(frozenset(n.strip() for n in text.split(",") if n.strip()))

    def wire_for(self, node_id: str, hardware_class: str) -> str:
        hit = "*" in self.names or node_id in self.names or hardware_class in self.names
        return FP8 if hit else NATIVE


NO_FP8 = Fp8Targets(frozenset())


@dataclass(frozen=True)
class Staged:
    """Room for one chunk's encoded bytes in a :class:`WireStaging` arena."""

    pages: Pages
    nbytes: int


class WireStaging:
    """A registered arena of ``nbytes`` cut in :data:`STAGING_PAGE` pages, for encoded
    chunks on their way out or in. Thread-safe."""

    def __init__(self, nbytes: int, name: str = "kvfabric-wire-staging") -> None:
        size = max(STAGING_PAGE, nbytes - nbytes % STAGING_PAGE)
        self.arena = SharedArena.create(size, STAGING_PAGE, name=name)
        self._pages = PageAllocator(size // STAGING_PAGE)
        self._lock = threading.Lock()

    @property
    def page_size(self) -> int:
        return STAGING_PAGE

    def take(self, nbytes: int) -> Staged | None:
        """Room for ``nbytes``, or None when the arena is full (the chunk goes native)."""
        count = -(-nbytes // STAGING_PAGE)
        with self._lock:
            if count > self._pages.free_pages:
                return None
            pages = self._pages.alloc(count)
        return Staged(pages, nbytes)

    def give(self, staged: Staged) -> None:
        with self._lock:
            self._pages.free(staged.pages)

    def pieces(self, staged: Staged, offset: int, length: int) -> list[np.ndarray]:
        flat, ps = self.arena.array, STAGING_PAGE
        return slice_pages(
            lambda p, s, e: flat[p * ps + s : p * ps + e], staged.pages, ps, offset, length
        )

    def checksum(self, staged: Staged, offset: int, length: int) -> int:
        digest = xxhash.xxh3_64()
        for piece in self.pieces(staged, offset, length):
            digest.update(piece.data)
        return digest.intdigest()

    def close(self) -> None:
        self.arena.close()


def encode_layers(
    staging: WireStaging, staged: Staged, reader: PayloadReader, first: int, stop: int
) -> tuple[int, int, int]:
    """Encode committed layers ``[first, stop)`` of ``reader``'s chunk into ``staged``:
    (offset, length) of their encoded bytes and the checksum of those bytes."""
    from kvfabric.convert import fp8, read_layer

    spec = reader.layout.spec
    per_layer = layer_nbytes(spec, reader.num_tokens)
    out = np.empty(per_layer, dtype=np.uint8)
    for layer in range(first, stop):
        fp8.encode_layer(read_layer(reader, layer), out=out)
        copy_pieces(staging.pieces(staged, layer * per_layer, per_layer), [out])
    offset, length = first * per_layer, (stop - first) * per_layer
    return offset, length, staging.checksum(staged, offset, length)


def land_chunk(staging: WireStaging, staged: Staged, writer: ObjectWriter, checksum: Any) -> None:
    """Check a whole encoded chunk in ``staged`` against ``checksum`` and decode it into
    ``writer``'s pages (a pulled chunk); ProtocolError when it does not match or decode."""
    spec = writer.layout.spec
    per_layer = layer_nbytes(spec, writer.num_tokens)
    if staged.nbytes != spec.num_layers * per_layer:
        raise ProtocolError(
            f"an fp8 chunk of {staged.nbytes} bytes, expected {spec.num_layers * per_layer}"
        )
    _check(staging, staged, 0, staged.nbytes, checksum, writer.key, 0, spec.num_layers)
    _decode(staging, staged, writer, 0, spec.num_layers, per_layer)


class Outbound:
    """The owner's side of a pull as fp8: pinned chunks encoded whole into staging, named
    in the ``peer_pin`` reply, given back when the pin is released (or its session ends)."""

    def __init__(self, staging: WireStaging) -> None:
        self.staging = staging
        self._sent: dict[int, tuple[ObjectReader, Staged]] = {}  # by reader identity
        self._lock = threading.Lock()

    def stage(self, reader: ObjectReader) -> dict[str, Any] | None:
        """Encode ``reader``'s complete chunk into staging: ``staging`` (placement and
        ``checksum``) for the reply; None when fp8 does not apply or there is no room."""
        self._reclaim()
        spec = reader.layout.spec
        if not wire_applies(spec):
            return None
        staged = self.staging.take(encoded_nbytes(spec, reader.num_tokens))
        if staged is None:
            return None
        try:
            _, _, checksum = encode_layers(self.staging, staged, reader, 0, spec.num_layers)
        except BaseException:
            self.staging.give(staged)
            raise
        with self._lock:
            self._sent[id(reader)] = (reader, staged)
        return {**_placement(staged), "checksum": checksum}

    def done(self, reader: ObjectReader) -> None:
        with self._lock:
            sent = self._sent.pop(id(reader), None)
        if sent is not None:
            self.staging.give(sent[1])

    def _reclaim(self) -> None:
        """Give back the staging of pins released without a word (their session closed)."""
        with self._lock:
            gone = [k for k, (reader, _) in self._sent.items() if reader.closed]
            ended = [self._sent.pop(k)[1] for k in gone]
        for staged in ended:
            self.staging.give(staged)


class Fp8Wire:
    """A node's fp8 ends, over one staging arena: receiving pushes (``inbound``) and
    serving pulls (``outbound``)."""

    def __init__(self, staging: WireStaging) -> None:
        self.staging = staging
        self.inbound = Inbound(staging)
        self.outbound = Outbound(staging)


def _placement(staged: Staged) -> dict[str, Any]:
    return {
        "arena": STAGING_REGION,
        "pages": np.asarray(staged.pages, dtype="<u4").tobytes(),
        "page_size": STAGING_PAGE,
        "nbytes": staged.nbytes,
    }


def _check(
    staging: WireStaging,
    staged: Staged,
    offset: int,
    length: int,
    checksum: Any,
    key: bytes,
    first: int,
    stop: int,
) -> None:
    if not isinstance(checksum, int) or isinstance(checksum, bool):
        raise ProtocolError("fp8 layers need their checksum")
    if staging.checksum(staged, offset, length) != checksum:
        raise ProtocolError(f"fp8 layers {first}-{stop - 1} of {key.hex()} failed their checksum")


@dataclass
class _Landing:
    writer: ObjectWriter
    staged: Staged


class Inbound:
    """The target's side: staging room per reservation that receives fp8, and the decode of
    committed layers into the reservation's pages (see the module docstring)."""

    def __init__(self, staging: WireStaging) -> None:
        self.staging = staging
        self._landing: dict[int, _Landing] = {}  # by writer identity
        self._lock = threading.Lock()

    def take(self, writer: ObjectWriter) -> dict[str, Any] | None:
        """Staging room for ``writer``'s chunk, as the ``staging`` of a ``peer_reserve``
        reply; None when there is none (the chunk then travels native)."""
        self._reclaim()
        spec = writer.layout.spec
        if not wire_applies(spec):
            return None
        staged = self.staging.take(encoded_nbytes(spec, writer.num_tokens))
        if staged is None:
            return None
        with self._lock:
            self._landing[id(writer)] = _Landing(writer, staged)
        return _placement(staged)

    def receives(self, writer: ObjectWriter) -> bool:
        with self._lock:
            return id(writer) in self._landing

    def land(self, writer: ObjectWriter, mask: int, checksum: Any) -> None:
        """Decode the layers in ``mask`` from staging into ``writer``'s pages, after checking
        ``checksum`` against the staged bytes. ProtocolError (the caller aborts the
        reservation) when it does not match or the bytes do not decode."""
        with self._lock:
            landing = self._landing.get(id(writer))
        if landing is None:
            return
        first, stop = _mask_range(mask)
        spec = writer.layout.spec
        per_layer = layer_nbytes(spec, writer.num_tokens)
        offset, length = first * per_layer, (stop - first) * per_layer
        _check(self.staging, landing.staged, offset, length, checksum, writer.key, first, stop)
        _decode(self.staging, landing.staged, writer, first, stop, per_layer)

    def done(self, writer: ObjectWriter) -> None:
        """``writer``'s reservation ended: give its staging back."""
        with self._lock:
            landing = self._landing.pop(id(writer), None)
        if landing is not None:
            self.staging.give(landing.staged)

    def _reclaim(self) -> None:
        """Give back the staging of reservations that ended without a word (their session
        closed, or they expired and were not closed within :data:`EXPIRED_GRACE_S`)."""
        now = time.monotonic()
        with self._lock:
            gone = [
                key
                for key, landing in self._landing.items()
                if landing.writer.closed
                or (landing.writer.expired and now > landing.writer.deadline + EXPIRED_GRACE_S)
            ]
            ended = [self._landing.pop(key) for key in gone]
        for landing in ended:
            self.staging.give(landing.staged)


def _mask_range(mask: int) -> tuple[int, int]:
    """``[first, stop)`` of a mask of consecutive layers (what a pusher commits)."""
    first = (mask & -mask).bit_length() - 1
    stop = mask.bit_length()
    if mask != (1 << stop) - (1 << first):
        raise ProtocolError("peer_commit: fp8 layers must be one run of consecutive layers")
    return first, stop


def _decode(
    staging: WireStaging, staged: Staged, writer: ObjectWriter, first: int, stop: int, per: int
) -> None:
    import torch

    from kvfabric.convert import fp8, torch_dtype

    spec = writer.layout.spec
    shape = (spec.kv_planes, spec.num_kv_heads, writer.num_tokens, spec.head_dim)
    encoded = np.empty(per, dtype=np.uint8)
    native = torch.empty(shape, dtype=torch_dtype(spec.dtype))
    for layer in range(first, stop):
        copy_pieces([encoded], staging.pieces(staged, layer * per, per))
        try:
            quantized = fp8.unpack(encoded, shape)
        except (ValueError, RuntimeError) as exc:
            raise ProtocolError(f"fp8 layer {layer} does not decode: {exc}") from None
        # a sender's bad bytes pass the checksum: with finite positive scales every e4m3fn
        # value decodes finite, but for its NaN encodings (0x7f, 0xff), looked for here
        if not bool(torch.isfinite(quantized.scales).all() and (quantized.scales > 0).all()):
            raise ProtocolError(f"fp8 layer {layer} carries a scale that is not a positive number")
        if bool(((quantized.data.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise ProtocolError(f"fp8 layer {layer} carries NaN values")
        fp8.dequantize(quantized.data, quantized.scales, native.dtype, out=native)
        pieces: list[Piece] = writer.layer_pieces(layer)
        copy_pieces(pieces, [native.view(torch.uint8).reshape(-1)])
