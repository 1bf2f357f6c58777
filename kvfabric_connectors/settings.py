"""What every engine plugin's settings share.

Each plugin's settings class is a configuration model (:func:`kvfabric.config_model.config_value`),
as the daemon's config is: unknown keys are an error (a typo must not fall back to a default
silently), every problem raises one :class:`~kvfabric.errors.ConfigError` (a ``ValueError``)
in the daemon config's message style, keyed as the engine's user wrote it
(``kv_connector_extra_config.load_timeout_s: must be a positive number of seconds, got -1``),
durations are positive, and keys in the plugin's table of renamed keys warn and are honoured.
The daemon's socket and token default to the node's environment (``KVFABRIC_SOCKET_PATH``,
``KVFABRIC_TOKEN``): :func:`daemon_socket`, :func:`daemon_token`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

from kvfabric.client.client import default_address
from kvfabric.config_model import apply_renames, parse_config

T = TypeVar("T")


def daemon_socket() -> str:
    return default_address()


def daemon_token() -> str | None:
    return os.environ.get("KVFABRIC_TOKEN")


def parse_settings(
    cls: type[T], values: Mapping[str, Any], *, where: str, renames: Mapping[str, str]
) -> T:
    """``values`` (an engine's extra-config keys for this plugin) validated into ``cls``;
    renamed keys moved first, problems keyed below ``where``."""
    return parse_config(cls, apply_renames(dict(values), renames), where)
