"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` JSON object.

SGLang pops its own prefetch keys (``prefetch_threshold``, ``prefetch_timeout_*``,
``hicache_storage_pass_prefix_keys``, ``tp_lcm_size``) before the backend sees the object;
``backend_name`` / ``module_path`` / ``class_name`` / ``interface_v1`` select this class and
the zero-copy path. Every other key is ours and optional; unknown keys are an error (a typo
must not silently fall back to a default). Environment variables give the node-level
defaults a DaemonSet sets once per node.

==============  ===========================================  ==============================
key             meaning                                      default
==============  ===========================================  ==============================
socket_path     the node daemon's Unix socket                ``$KVFABRIC_SOCKET_PATH``
token           the daemon's auth token                      ``$KVFABRIC_TOKEN``
model_id        namespace model id (the same on every        SGLang's ``model_name``
                engine that may share KV)
cache_salt      tenant salt: engines with different salts    ``""``
                never share a page
timeout_s       deadline of one storage call (a batch of     10
                up to 128 pages, a pull included)
pull            ask the cluster for pages this node lacks    true
                and pull them (needs a daemon in a redis
                cluster; a single node answers locally)
==============  ===========================================  ==============================
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from kvfabric.config_model import config_value
from kvfabric.config_types import Flag, OptionalText, Seconds, Text
from kvfabric_connectors.settings import daemon_socket, daemon_token, parse_settings

# Keys of the extra config that SGLang itself reads (the dynamic-backend factory and the
# cache controller), left in the object it hands to the backend.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# Old key -> new key: a renamed setting keeps working (with a DeprecationWarning) a release.
RENAMED_KEYS: dict[str, str] = {}


@config_value
class StorageSettings:
    socket_path: Text = field(default_factory=daemon_socket)
    token: OptionalText = field(default_factory=daemon_token)
    model_id: OptionalText = None
    cache_salt: Text = ""
    timeout_s: Seconds = 10.0
    pull: Flag = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> StorageSettings:
        ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        return parse_settings(cls, ours, where="extra_config", renames=RENAMED_KEYS)
