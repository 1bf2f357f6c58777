"""Redis backend of the global index (redis-py against a real server or a Redis Cluster).

The URL picks the client: ``redis://host:port/0`` a single server (``redis.Redis``),
``redis+cluster://host:port/0`` a Redis Cluster (``redis.cluster.RedisCluster``; the host is one
startup node, the client discovers the others; the database must be 0). Both get the same
socket timeouts and no retries.

Key layout (``P`` = ``prefix``; the ``{...}`` hash tag picks the Redis Cluster slot, so every
multi-key script touches one slot only)::

    P:{<seed hex>}:owners           hash  <key, 16 bytes> -> 'node|epoch|tier,node|epoch|tier...'
                                          (and '' -> a long filler: see _UPDATE)
    P:{<seed hex>}:meta             hash  <key, 16 bytes> -> parent || u32le tokens
    P:{<seed hex>}:live             hash  node -> '<epoch>:<lease deadline, server ms>'
    P:{reg}:live                    hash  node -> '<epoch>:<deadline>' (the registry's leases)
    P:{reg}:node:<node>             hash  the NodeInfo fields
    P:{reg}:epoch:<node>            counter of the node's epochs
    P:{reg}:seeds:<node>            set of namespaces the node ever published in
    P:{events}:stream               stream of KV events (XADD MAXLEN ~ max_events); stored runs
                                          carry their token ids, when the node published
                                          them (the only place they are kept; their cost:
                                          :mod:`kvfabric.cluster.events`)

A chain lookup is one short script: one ``HMGET`` of the chain's owner lists (it stops at
the first chunk nobody holds) plus the namespace's live hash and the server clock, answered as
one string; the client drops entries of nodes that are not live, or live under another epoch,
itself. Liveness is judged against the server clock (no client clock skew): an entry counts
only if its node's live field carries the same epoch and a deadline in the future.
``register`` writes the new epoch into every namespace the node ever used before it returns,
so a restarted node's old entries vanish at once; a lookup that meets superseded entries
deletes them afterwards. Owner lists change only through a script, so nodes storing the same
chunk at once never lose each other's entries.

On a Redis Cluster every script touches the keys of one slot. Pipelines are not transactions
here: a pipeline that spans slots (a heartbeat renewing the leases of several namespaces, a
batch of updates to several namespaces plus its events) is split by redis-py into one batch per
cluster node, each command on one slot; writes whose order matters across slots (a namespace
joins the node's seeds set before any entry is written there) go in an earlier round trip.
Server time is always read on the node that holds the key it is compared with (the live hash
of the registry or of the namespace), since cluster nodes' clocks may differ. redis-py refuses
EVALSHA in a cluster pipeline (it could not load a script a node lacks), so scripts queued in
one are sent as EVAL (their text; Redis caches it).

Every call has socket timeouts and no retries: a dead server costs at most ``socket_timeout``
and raises :class:`~kvfabric.errors.UnavailableError`.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvfabric.cluster import events as codec
from kvfabric.cluster.index import (
    BatchingIndex,
    ChunkRecord,
    GlobalLookup,
    IndexSnapshot,
    Inventory,
    KVEvent,
    LiveRegistration,
    Location,
    NodeInfo,
    Update,
    check_key,
    parse_stream_id,
    refuse_duplicate,
)
from kvfabric.errors import LeaseExpiredError, SpecError, UnavailableError
from kvfabric.hashing import KEY_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")
_META = struct.Struct("<I")
MAX_BLOCK_MS = 10_000
CLUSTER_SCHEME = "redis+cluster"
_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

# KEYS[1] live hash; ARGV node, epoch, ttl_ms. 0: a newer epoch owns the node (nothing
# written); 1: renewed; 2: renewed, but the lease had lapsed or was missing (entries may be
# gone: the caller republishes).
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = tonumber(ARGV[2])
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local status = 2
if cur then
  local e, d = string.match(cur, '^(%d+):(%d+)$')
  if tonumber(e) > epoch then return 0 end
  if tonumber(e) == epoch and tonumber(d) > now then status = 1 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now + tonumber(ARGV[3])))
return status
"""

# KEYS[1] epoch counter, KEYS[2] seeds set; ARGV min_epoch. Returns {epoch, seeds...}.
_NEW_EPOCH = """
local e = redis.call('INCR', KEYS[1])
if e < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]); e = tonumber(ARGV[1]) end
local out = redis.call('SMEMBERS', KEYS[2])
table.insert(out, 1, e)
return out
"""

# KEYS[1] owners hash, KEYS[2] meta hash of one namespace; ARGV (kind, key, owner, meta)
# quadruples: kind 'S' adds owner 'node|epoch|tier' to the chunk's list (and sets its meta),
# 'R' removes it (the chunk's fields go with its last owner). The owners hash also holds one
# field '' with a value longer than any listpack value: Redis then keeps the hash in its
# hashtable encoding even while it is small, where a listpack would make the lookup's HMGET
# of a whole chain quadratic (up to hash-max-listpack-entries fields).
_UPDATE = """
redis.call('HSETNX', KEYS[1], '', string.rep('-', 1024))
for i = 1, #ARGV, 4 do
  local key, owner = ARGV[i + 1], ARGV[i + 2]
  local cur = redis.call('HGET', KEYS[1], key)
  if ARGV[i] == 'S' then
    if not cur then
      redis.call('HSET', KEYS[1], key, owner)
    elseif not string.find(',' .. cur .. ',', ',' .. owner .. ',', 1, true) then
      redis.call('HSET', KEYS[1], key, cur .. ',' .. owner)
    end
    redis.call('HSET', KEYS[2], key, ARGV[i + 3])
  elseif cur then
    local rest = {}
    for o in string.gmatch(cur, '[^,]+') do
      if o ~= owner then rest[#rest + 1] = o end
    end
    if #rest == 0 then
      redis.call('HDEL', KEYS[1], key)
      redis.call('HDEL', KEYS[2], key)
    else
      redis.call('HSET', KEYS[1], key, table.concat(rest, ','))
    end
  end
end
return 0
"""

# KEYS[1] owners hash, KEYS[2] live hash of one namespace; ARGV[1] the chain's keys, 16 bytes
# each. Returns {seconds, microseconds, live hash as a flat list, owner lists of the chain's
# leading chunks joined by '\n' (up to the first chunk nobody holds)}.
_LOOKUP = """
local t = redis.call('TIME')
local function leading(chain)
  local lists = {}
  local step = 16 * 1000  -- keys per HMGET: Lua's unpack takes a few thousand values at most
  for first = 1, #chain, step do
    local keys = {}
    for i = first, math.min(first + step - 1, #chain), 16 do
      keys[#keys + 1] = string.sub(chain, i, i + 15)
    end
    local got = redis.call('HMGET', KEYS[1], unpack(keys))
    for i = 1, #keys do
      if not got[i] then return lists end
      lists[#lists + 1] = got[i]
    end
  end
  return lists
end
local lists = leading(ARGV[1])
return {t[1], t[2], redis.call('HGETALL', KEYS[2]), table.concat(lists, '\\n')}
"""

# KEYS[1] a live hash. Returns {seconds, microseconds, the hash as a flat list}: the clock of
# the node that holds the hash (the one its deadlines were written with).
_LIVE = """
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGETALL', KEYS[1])}
"""


# KEYS[1] the registry's live hash, KEYS[2] the node's hash; ARGV node. Returns {the live
# entry ('epoch:deadline_ms') or false, now_ms, the registered address or false}.
_REGISTRATION = """
local t = redis.call('TIME')
return {redis.call('HGET', KEYS[1], ARGV[1]),
        tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
        redis.call('HGET', KEYS[2], 'address')}
"""


class RedisGlobalIndex(BatchingIndex):
    """One node's (or router's) client of the Redis global index.

    ``inventory``, when given, returns the node's whole local inventory; the flusher calls it
    to republish by itself once Redis is reachable again after a loss (or after this node's
    lease lapsed). Without it the owner calls :meth:`republish` when :attr:`stale` is set.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvf",
        lease_ttl: float = 10.0,
        socket_timeout: float = 0.5,
        max_events: int = 1_000_000,
        flush_interval: float = 0.005,
        max_batch: int = 4096,
        inventory: Inventory | None = None,
        retry_interval: float = 0.5,
    ) -> None:
        if lease_ttl <= 0 or socket_timeout <= 0 or max_events <= 0 or retry_interval <= 0:
            raise SpecError("lease_ttl, socket_timeout, max_events, retry_interval must be > 0")
        self._p = prefix
        self._ttl_ms = max(1, int(lease_ttl * 1000))
        self._max_events = max_events
        self._inventory = inventory
        self._retry_interval = retry_interval
        self._next_retry = 0.0
        common: dict[str, Any] = {
            "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        scheme, sep, rest = url.partition("://")
        self._cluster = sep != "" and scheme.lower() == CLUSTER_SCHEME
        if self._cluster:
            # RedisCluster takes ``retry`` for its own retries (after a connection error or
            # cluster-down: none) and gives its node connections none.
            url = f"redis://{rest}"
        client: Any = redis.cluster.RedisCluster if self._cluster else redis.Redis
        try:  # RedisCluster asks a startup node for the slot map right here
            self._r = client.from_url(url, socket_timeout=socket_timeout, **common)
            # Blocking XREADs need a read timeout longer than the longest block.
            self._blocking = client.from_url(
                url, socket_timeout=socket_timeout + MAX_BLOCK_MS / 1000, **common
            )
        except _ERRORS as exc:
            raise UnavailableError(f"global index (Redis) unavailable: {exc}") from None
        self._hb = self._r.register_script(_HEARTBEAT)
        self._new_epoch = self._r.register_script(_NEW_EPOCH)
        self._update = self._r.register_script(_UPDATE)
        self._lookup = self._r.register_script(_LOOKUP)
        self._live = self._r.register_script(_LIVE)
        self._registration = self._r.register_script(_REGISTRATION)
        self._send_lock = threading.RLock()  # one writer at a time: flusher vs. republish
        self._info: NodeInfo | None = None
        self._seeds: set[bytes] = set()  # namespaces whose live hash carries our epoch
        self._stale = False
        self._stream = f"{prefix}:{{events}}:stream"
        super().__init__(flush_interval=flush_interval, max_batch=max_batch)

    # -- keys ---------------------------------------------------------------------------
    def _ns_key(self, seed: bytes, what: str) -> str:
        return f"{self._p}:{{{seed.hex()}}}:{what}"

    def _live_key(self, seed: bytes | None) -> str:
        return f"{self._p}:{{{'reg' if seed is None else seed.hex()}}}:live"

    def _reg(self, what: str, node_id: str) -> str:
        return f"{self._p}:{{reg}}:{what}:{node_id}"

    # -- errors -------------------------------------------------------------------------
    @property
    def stale(self) -> bool:
        return self._stale

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _ERRORS as exc:
            self._stale = True
            raise UnavailableError(f"global index (Redis) unavailable: {exc}") from None

    # -- registry -----------------------------------------------------------------------
    def register(self, info: NodeInfo, *, takeover_after_s: float = 0.0) -> NodeInfo:
        if self._info is None or self._info.node_id != info.node_id:  # not a re-register
            refuse_duplicate(info, lambda: self._live_registration(info.node_id), takeover_after_s)
        with self._send_lock:
            return self._register(info)

    def _live_registration(self, node_id: str) -> LiveRegistration | None:
        def run() -> list[Any]:
            reply: list[Any] = self._registration(
                keys=[self._live_key(None), self._reg("node", node_id)], args=[node_id]
            )
            return reply

        live, now_ms, address = self._call(run)
        if not live:
            return None
        epoch, deadline = (int(x) for x in live.split(b":"))
        if deadline <= int(now_ms):
            return None
        return LiveRegistration(address.decode() if address else "", epoch, deadline)

    def _register(self, info: NodeInfo) -> NodeInfo:
        min_epoch = self._info.epoch + 1 if self._info is not None else 1
        node = info.node_id

        def run() -> NodeInfo:
            reply = self._new_epoch(
                keys=[self._reg("epoch", node), self._reg("seeds", node)], args=[min_epoch]
            )
            new = replace(info, epoch=int(reply[0]))
            seeds = {bytes.fromhex(s.decode()) for s in reply[1:]}
            pipe = self._r.pipeline(transaction=False)
            pipe.hset(
                self._reg("node", node),
                mapping={
                    "address": new.address,
                    "tiers": ",".join(new.tiers),
                    "hardware_class": new.hardware_class,
                    "transports": json.dumps(new.transports, sort_keys=True),
                    "epoch": new.epoch,
                },
            )
            self._renew(pipe, new, [None, *seeds])
            pipe.execute()
            return new

        new = self._call(run)
        self._info, self._seeds = new, set()
        return new

    def _renew(self, pipe: Any, info: NodeInfo, seeds: Iterable[bytes | None]) -> None:
        for seed in seeds:
            self._script(
                self._hb, [self._live_key(seed)], [info.node_id, info.epoch, self._ttl_ms], pipe
            )

    def heartbeat(self) -> None:
        info = self._require_info()
        seeds = [None, *self._seeds]

        def run() -> list[int]:
            pipe = self._r.pipeline(transaction=False)
            self._renew(pipe, info, seeds)
            return [int(x) for x in pipe.execute()]

        statuses = self._call(run)
        if 0 in statuses:
            current = self._info
            if current is not None and current.epoch != info.epoch:
                return  # this client re-registered meanwhile (a republish): not another node
            raise LeaseExpiredError(f"node {info.node_id} epoch {info.epoch} was replaced")
        if statuses[0] == 2:  # lease lapsed (or Redis lost it): our entries can't be trusted
            self._stale = True

    def nodes(self) -> list[NodeInfo]:
        def run() -> list[NodeInfo]:
            epochs = self._live_epochs(None)
            pipe = self._r.pipeline(transaction=False)
            for node in epochs:
                pipe.hgetall(self._reg("node", node))
            out = []
            for (node, epoch), fields in zip(epochs.items(), pipe.execute()):
                raw = {k.decode(): v.decode() for k, v in fields.items()}
                if int(raw.get("epoch", -1)) != epoch:
                    continue  # registered a newer epoch that has not taken its lease yet
                out.append(
                    NodeInfo(
                        node,
                        raw["address"],
                        tuple(t for t in raw["tiers"].split(",") if t),
                        raw["hardware_class"],
                        json.loads(raw["transports"]),
                        epoch,
                    )
                )
            return out

        return self._call(run)

    # -- writes -------------------------------------------------------------------------
    def _send(self, batch: list[Update]) -> None:
        with self._send_lock:
            if self._stale:
                raise UnavailableError("stale: updates wait for republish")
            self._write(batch)

    def _write(self, batch: Sequence[Update]) -> None:
        info = self._info
        if info is None:
            raise UnavailableError("publish before register(): updates dropped")
        new_seeds = {rec.seed for _, rec in batch} - self._seeds
        owner_prefix = f"{info.node_id}|{info.epoch}|"

        def run() -> None:
            pipe = self._r.pipeline(transaction=False)
            if new_seeds:  # a restart must find the namespace before it holds any entry of ours
                pipe.sadd(self._reg("seeds", info.node_id), *(seed.hex() for seed in new_seeds))
                if self._cluster:  # another slot: a cluster pipeline keeps no order across nodes
                    pipe.execute()
            self._renew(pipe, info, new_seeds)  # before the entries, in their slot
            per_seed: dict[bytes, list[bytes | str]] = {}
            for kind, rec in batch:
                per_seed.setdefault(rec.seed, []).extend(
                    ("S", rec.key, owner_prefix + rec.tier, rec.parent + _META.pack(rec.num_tokens))
                    if kind == "stored"
                    else ("R", rec.key, owner_prefix + rec.tier, b"")
                )
            for seed, args in per_seed.items():
                self._update_owners(seed, args, pipe)
            for event in codec.batch_events(batch, info.node_id, info.epoch):
                pipe.xadd(
                    self._stream, codec.encode(event), maxlen=self._max_events, approximate=True
                )
            pipe.execute()

        self._call(run)
        self._seeds |= new_seeds

    def _update_owners(self, seed: bytes, args: Sequence[bytes | str], client: Any) -> None:
        self._script(
            self._update, [self._ns_key(seed, "owners"), self._ns_key(seed, "meta")], args, client
        )

    def _script(
        self, script: Any, keys: Sequence[str], args: Sequence[Any], pipe: Any | None
    ) -> Any:
        """Run (or queue in ``pipe``) a script on keys of one slot."""
        if pipe is not None and self._cluster:
            return pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=pipe)

    def republish(self, inventory: Iterable[ChunkRecord]) -> None:
        """Pass a lazy iterable (or use the ``inventory`` callback): it is read after the
        queue is dropped, so nothing published meanwhile is lost."""
        self._republish(lambda: inventory)

    def _republish(self, source: Callable[[], Iterable[ChunkRecord]]) -> None:
        info = self._require_info()
        with self._send_lock:
            self._discard_pending()
            self._register(info)
            batch: list[Update] = []
            for rec in source():
                batch.append(("stored", rec))
                if len(batch) >= self._max_batch:
                    self._write(batch)
                    batch = []
            if batch:
                self._write(batch)
            self._stale = False

    def _tick(self) -> None:
        if not self._stale or self._inventory is None or self._info is None:
            return
        now = time.monotonic()
        if now >= self._next_retry:
            self._next_retry = now + self._retry_interval
            self._republish(self._inventory)

    # -- reads --------------------------------------------------------------------------
    def lookup(self, seed: bytes, keys: Sequence[bytes]) -> GlobalLookup:
        check_key("namespace seed", seed)
        for key in keys:
            check_key("chunk key", key)
        if not keys:
            return GlobalLookup(0, (), self._stale)
        now_s, now_us, live, lists = self._call(
            lambda: self._lookup(
                keys=[self._ns_key(seed, "owners"), self._live_key(seed)], args=[b"".join(keys)]
            )
        )
        view = _LiveView(dict(zip(live[::2], live[1::2])), int(now_s) * 1000 + int(now_us) // 1000)
        owners: list[tuple[Location, ...]] = []
        superseded: list[bytes | str] = []
        for key, raw in zip(keys, lists.split(b"\n") if lists else ()):
            row, old = view.row(raw)
            for owner in old:
                superseded += ("R", key, owner, b"")
            if not row:
                break
            owners.append(row)
        if superseded:
            self._clean(seed, superseded)
        return GlobalLookup(len(keys), tuple(owners), self._stale)

    def _clean(self, seed: bytes, removals: list[bytes | str]) -> None:
        """Delete entries of superseded epochs a lookup met; best effort: the next lookup
        that meets them tries again, and readers ignore them meanwhile."""
        try:
            self._update_owners(seed, removals, None)
        except _ERRORS as exc:
            log.info("could not delete superseded index entries: %s", exc)

    def events(self, after_id: str = "0-0", block_ms: int = 0, count: int = 1000) -> list[KVEvent]:
        parse_stream_id(after_id)
        if not 0 <= block_ms <= MAX_BLOCK_MS or count <= 0:
            raise SpecError(f"block_ms must be in [0, {MAX_BLOCK_MS}] and count positive")
        client = self._blocking if block_ms else self._r
        reply = self._call(
            lambda: client.xread({self._stream: after_id}, count=count, block=block_ms or None)
        )
        out: list[KVEvent] = []
        for _, entries in reply or ():
            out += [codec.decode(ident.decode(), fields) for ident, fields in entries]
        return out

    def snapshot(self) -> IndexSnapshot:
        return self._call(self._snapshot)

    def first_event_id(self) -> str:
        first = self._call(lambda: self._r.xrange(self._stream, count=1))
        return first[0][0].decode() if first else "0-0"

    def _snapshot(self) -> IndexSnapshot:
        # The id is taken first: events after it may already show in the scan, and replaying
        # them is harmless (idempotent), whereas taking it last could skip some.
        last = self._r.xrevrange(self._stream, count=1)
        stream_id = last[0][0].decode() if last else "0-0"
        out: list[KVEvent] = []
        for name in self._r.scan_iter(match=f"{self._p}:{{*}}:owners", count=1000):
            seed = bytes.fromhex(name.decode().split(":")[-2][1:-1])
            live = self._live_epochs(seed)
            entries = self._r.hscan_iter(name, count=1000)
            for batch in _batches(entries):
                metas = self._r.hmget(self._ns_key(seed, "meta"), [key for key, _ in batch])
                for (key, raw), meta in zip(batch, metas):
                    if meta is None or len(meta) != KEY_BYTES + _META.size:
                        continue  # the filler field, or a chunk removed meanwhile
                    parent, (tokens,) = meta[:KEY_BYTES], _META.unpack(meta[KEY_BYTES:])
                    for field in raw.split(b","):
                        loc = _location(field)
                        if live.get(loc.node_id) == loc.epoch:
                            out.append(
                                KVEvent(
                                    "stored",
                                    (key,),
                                    loc.tier,
                                    loc.node_id,
                                    loc.epoch,
                                    seed.hex(),
                                    parent,
                                    tokens,
                                )
                            )
        return IndexSnapshot(stream_id, tuple(out))

    def _live_epochs(self, seed: bytes | None) -> dict[str, int]:
        """Live nodes' epochs of a namespace (None: the registry), by its node's clock."""
        now_s, now_us, flat = self._live(keys=[self._live_key(seed)])
        return _live_epochs(
            dict(zip(flat[::2], flat[1::2])), int(now_s) * 1000 + int(now_us) // 1000
        )

    def close(self) -> None:
        self._stop_flusher()
        self._r.close()
        self._blocking.close()

    def _require_info(self) -> NodeInfo:
        if self._info is None:
            raise SpecError("call register() first")
        return self._info


def _location(field: bytes) -> Location:
    node, epoch, tier = field.decode().split("|", 2)
    return Location(node, int(epoch), tier)


def _live_epochs(raw: dict[bytes, bytes], now_ms: int) -> dict[str, int]:
    out = {}
    for node, value in raw.items():
        epoch, deadline = (int(x) for x in value.split(b":"))
        if deadline > now_ms:
            out[node.decode()] = epoch
    return out


class _LiveView:
    """Which owner entries of a lookup count, given the namespace's live hash at ``now_ms``
    (server clock). Chains repeat the same owner lists, so each distinct list is parsed once."""

    def __init__(self, live: dict[bytes, bytes], now_ms: int) -> None:
        self._epochs: dict[str, tuple[int, bool]] = {}  # node -> (epoch, lease still running)
        for node, value in live.items():
            epoch, deadline = (int(x) for x in value.split(b":"))
            self._epochs[node.decode()] = (epoch, deadline > now_ms)
        self._rows: dict[bytes, tuple[tuple[Location, ...], tuple[str, ...]]] = {}

    def row(self, raw: bytes) -> tuple[tuple[Location, ...], tuple[str, ...]]:
        """(live copies, entries of superseded epochs) of one owner list."""
        known = self._rows.get(raw)
        if known is None:
            live, old = [], []
            for field in raw.split(b","):
                loc = _location(field)
                epoch, running = self._epochs.get(loc.node_id, (0, False))
                if loc.epoch == epoch and running:
                    live.append(loc)
                elif loc.epoch < epoch:
                    old.append(field.decode())
            known = self._rows[raw] = (tuple(live), tuple(old))
        return known


def _batches(items: Iterable[T], size: int = 500) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
