"""The plugin's settings: LMCache ``extra_config`` keys ``remote_storage_plugin.<name>.<key>``.

Every key is optional; an unknown key under the plugin's prefix is an error (a typo must not
silently fall back to a default). Values may be strings (LMCache reads them from YAML or
environment variables). Environment variables give the node-level defaults.

=============  ==============================================  ==============================
key            meaning                                         default
=============  ==============================================  ==============================
socket_path    the node daemon's Unix socket                   ``$KVFABRIC_SOCKET_PATH``
token          the daemon's auth token                         ``$KVFABRIC_TOKEN``
model_id       namespace model id (same on every engine that   ``lmcache:<model_name>``
               may share KV)
tenant         namespace tenant salt (KV is never shared       ``""``
               across tenants)
lora_id        namespace LoRA id                               ``""``
timeout_s      deadline of one daemon request                  10
pull           on a local miss, have the daemon pull the       true
               chunks from other nodes (redis cluster)
pull_timeout_s deadline of one pull                            2
retry_after_s  how long an unreachable daemon is left alone    2
threads        threads doing daemon requests and page copies   2
=============  ==============================================  ==============================

``module_path`` and ``class_name`` are LMCache's own (they load the plugin).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvfabric_connectors.settings import refuse_unknown, with_daemon_defaults

LMCACHE_KEYS = ("module_path", "class_name")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _number(name: str, value: Any, kind: type) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return number


@dataclass(frozen=True)
class PluginSettings:
    socket_path: str
    token: str | None
    model_id: str | None = None
    tenant: str = ""
    lora_id: str = ""
    timeout_s: float = 10.0
    pull: bool = True
    pull_timeout_s: float = 2.0
    retry_after_s: float = 2.0
    threads: int = 2

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, plugin_name: str) -> PluginSettings:
        prefix = f"remote_storage_plugin.{plugin_name}."
        mine = {
            k[len(prefix) :]: v
            for k, v in (extra or {}).items()
            if isinstance(k, str) and k.startswith(prefix)
        }
        for key in LMCACHE_KEYS:
            mine.pop(key, None)
        refuse_unknown(mine, {f.name for f in fields(cls)}, what="kvfabric plugin", prefix=prefix)
        with_daemon_defaults(mine)
        for name in ("socket_path", "tenant", "lora_id"):
            mine[name] = str(mine.get(name, ""))
        if not mine["socket_path"]:
            raise ValueError("socket_path must not be empty")
        for name in ("model_id", "token"):
            if mine.get(name) is not None:
                mine[name] = str(mine[name]) or None
        if "pull" in mine:
            mine["pull"] = _bool("pull", mine["pull"])
        for name in ("timeout_s", "pull_timeout_s", "retry_after_s"):
            if name in mine:
                mine[name] = _number(name, mine[name], float)
        if "threads" in mine:
            threads = _number("threads", mine["threads"], float)
            if threads != int(threads):
                raise ValueError(f"threads must be a whole number, got {mine['threads']!r}")
            mine["threads"] = int(threads)
        return cls(**mine)
