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

from dataclasses import field
from typing import Annotated, Any

from pydantic import PlainValidator

from kvfabric.config_model import config_value
from kvfabric.errors import ConfigError
from kvfabric_connectors.settings import daemon_socket, daemon_token, parse_settings

LMCACHE_KEYS = ("module_path", "class_name")
# Old key -> new key: a renamed setting keeps working (with a DeprecationWarning) a release.
RENAMED_KEYS: dict[str, str] = {}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# LMCache hands over what its YAML or environment held: a value may be any scalar or a string
# spelling one, so these validators read strings (and only these settings do).


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"must be true or false, got {value!r}")


def _positive(value: object) -> float:
    try:
        number = 0.0 if isinstance(value, bool) else float(str(value))
    except ValueError:
        number = 0.0
    if not number > 0:
        raise ConfigError(f"must be a positive number, got {value!r}")
    return number


def _whole(value: object) -> int:
    number = _positive(value)
    if number != int(number):
        raise ConfigError(f"must be a whole number, got {value!r}")
    return int(number)


def _text(value: object) -> str:
    return str(value)


def _socket(value: object) -> str:
    if not str(value):
        raise ConfigError("must not be empty")
    return str(value)


def _text_or_none(value: object) -> str | None:
    return None if value is None else str(value) or None


Positive = Annotated[float, PlainValidator(_positive)]
AnyText = Annotated[str, PlainValidator(_text)]
TextOrNone = Annotated[str | None, PlainValidator(_text_or_none)]


@config_value
class PluginSettings:
    socket_path: Annotated[str, PlainValidator(_socket)] = field(default_factory=daemon_socket)
    token: TextOrNone = field(default_factory=daemon_token)
    model_id: TextOrNone = None
    tenant: AnyText = ""
    lora_id: AnyText = ""
    timeout_s: Positive = 10.0
    pull: Annotated[bool, PlainValidator(_bool)] = True
    pull_timeout_s: Positive = 2.0
    retry_after_s: Positive = 2.0
    threads: Annotated[int, PlainValidator(_whole)] = 2

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, plugin_name: str) -> PluginSettings:
        prefix = f"remote_storage_plugin.{plugin_name}."
        mine = {
            k[len(prefix) :]: v
            for k, v in (extra or {}).items()
            if isinstance(k, str) and k.startswith(prefix) and k[len(prefix) :] not in LMCACHE_KEYS
        }
        return parse_settings(cls, mine, where=prefix.rstrip("."), renames=RENAMED_KEYS)
