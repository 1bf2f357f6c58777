"""kvfabric as an LMCache remote storage plugin (``lmcache==0.5.6``).

Turn it on in the LMCache config (YAML, or the same keys through ``LMCACHE_*``)::

    chunk_size: 256
    local_cpu: true                 # the remote backend needs LMCache's CPU buffer
    max_local_cpu_size: 5
    remote_serde: naive             # the plugin stores LMCache's raw chunk bytes
    remote_storage_plugins: ["kvfabric"]
    extra_config:
      remote_storage_plugin.kvfabric.module_path: kvfabric_connectors.lmcache
      remote_storage_plugin.kvfabric.class_name: KVFabricConnectorAdapter
      remote_storage_plugin.kvfabric.socket_path: /run/kvfabric/kvfabric.sock   # optional
      remote_storage_plugin.kvfabric.tenant: team-a                             # optional

The plugin name must be ``kvfabric`` or ``kvfabric.<instance>``; its settings are in
:mod:`kvfabric_connectors.lmcache.settings`, the key mapping in
:mod:`kvfabric_connectors.lmcache.keys`.

Contract with LMCache's ``RemoteBackend`` (what :class:`KVFabricRemoteConnector` honours):

* ``exists`` / ``get`` / ``put`` / ``batched_*`` are coroutines on LMCache's event loop; the
  daemon round trips and page copies run on the plugin's own threads, never on that loop.
  ``exists_sync`` and ``batched_contains`` are truly synchronous (they never touch the loop,
  so they are safe from any thread, the loop's included).
* ``put`` / ``batched_put`` copy the memory object's bytes straight into the daemon's shared
  pages (reserve -> write -> commit) and leave its ref count alone: the caller
  (``InstrumentedRemoteConnector``) gives the reference back.
* **kvfabric never overwrites a stored key** (LMCache's Redis and fs backends do: their
  last put wins). The first put of a key stays until it is evicted or deleted; a later put
  of the same key is dropped (counted as ``put_existing``, not an error). Keys hash the tokens,
  the model name and the memory layout, so a second put normally carries the same bytes;
  but after changing what a model name computes (new weights, another KV dtype under the
  same layout) the old KV would be served: give the new model another ``model_id`` (or
  delete the old chunks) instead of relying on an overwrite.
* ``get`` allocates the memory object from LMCache's ``LocalCPUBackend`` and copies the
  pinned pages straight into it (a shorter, unfull chunk comes back reshaped); ``None`` is
  a miss. ``batched_get`` returns one entry per key, ``None`` for each miss.
* ``batched_contains`` / ``batched_async_contains`` return the number of consecutive hits
  from the first key (one daemon lookup round trip).
* When the daemon is part of a redis cluster, the lookup asks the cluster (``scope:
  cluster``), and chunks only other nodes hold are pulled (``prefetch``) before answering;
  the daemon counts them as hits from ``peer``, the pull in its pull counters. A daemon
  without peers turns pulling off for the connector's lifetime.
* A missing or restarting daemon is a miss, never an error in the engine: the link stays
  away for ``retry_after_s`` and reconnects by itself.
* ``remote_serde`` must be ``naive``: the chunk's byte length is its token count.

Hits and bytes are counted per connector (:meth:`KVFabricRemoteConnector.stats`, and
:func:`plugin_stats` for all of a process) and exported to ``prometheus_client``'s default
registry as ``kvfabric_plugin_*{engine="lmcache",plugin=...}``; the daemon counts the same
traffic under the namespace model id ``lmcache:<model>``.
"""

from .connector import KVFabricConnectorAdapter, KVFabricRemoteConnector, plugin_stats

__all__ = ["KVFabricConnectorAdapter", "KVFabricRemoteConnector", "plugin_stats"]
