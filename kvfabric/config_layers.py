"""The layers of the daemon's configuration, merged into one plain mapping before validation.

:func:`layered` reads the YAML file, then applies ``KVFABRIC_*`` environment variables, then
``--set key=value`` flags (later layers win); :mod:`kvfabric.config` validates the result.
Every setting has a dotted key (``http.port``, ``store.data_dir``,
``store.tiers.dram.capacity``: tiers are addressed by name); its environment variable is
``KVFABRIC_`` + the key upper-cased with ``.`` -> ``__``
(``KVFABRIC_STORE__TIERS__DRAM__CAPACITY=4GiB``). Values from the environment and flags are
parsed as YAML scalars (``8080`` is an int, ``true`` a bool, ``"007"`` a string).

Then keys renamed since a release move to their new names (:data:`RENAMED_KEYS`, with a
DeprecationWarning each), and a leading ``~`` in a path setting (:data:`HOME_PATHS`) becomes
the daemon user's home. Problems of the layers themselves (an unreadable file, a flag
without ``=``) raise :class:`~kvfabric.errors.ConfigError` in the one message style
(``<key>: <what is wrong>``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvfabric.config_model import apply_renames
from kvfabric.errors import ConfigError
from kvfabric.store.config import default_tiers

ENV_PREFIX = "KVFABRIC_"
# Client-side variables that share the prefix (the CLI's token, the entry script's python):
# never settings of the daemon, so a shell that exports them can still serve.
CLIENT_ONLY_ENV = frozenset({"KVFABRIC_TOKEN", "KVFABRIC_PYTHON"})

# Old dotted key -> new dotted key: a renamed setting keeps working (with a warning) for a
# release. Keys of sections only (not of one tier in store.tiers).
RENAMED_KEYS: dict[str, str] = {}

# Settings holding a path where a leading ``~`` means the daemon user's home, as in a shell
# (configs/dev.yaml keeps everything under ~/.local/share/kvfabric).
HOME_PATHS = (
    ("socket_path",),
    ("store", "data_dir"),
    ("auth", "token_file"),
    ("cluster", "secret_file"),
    ("security", "tls_cert_file"),
    ("security", "tls_key_file"),
    ("security", "tls_client_ca_file"),
)


def layered(
    path: str | os.PathLike[str] | None, env: Mapping[str, str], overrides: Sequence[str]
) -> dict[str, Any]:
    """File, then environment, then ``key=value`` overrides: one mapping, not validated."""
    data = read_file(path) if path is not None else {}
    for name, value in sorted(env.items()):
        if name.startswith(ENV_PREFIX) and name != ENV_PREFIX and name not in CLIENT_ONLY_ENV:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            set_path(data, dotted, scalar(value), source=f"environment {name}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        set_path(data, dotted.strip(), scalar(value), source=f"--set {dotted.strip()}")
    return expand_home(apply_renames(data, RENAMED_KEYS))


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config {str(path)!r} must be a mapping at the top level")
    return loaded or {}


def expand_home(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``~`` expanded in the :data:`HOME_PATHS` settings (copied, not changed)."""
    out = dict(data)
    for path in HOME_PATHS:
        node: Any = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                break
            node[part] = node = dict(node[part])
        else:
            value = node.get(path[-1])
            if isinstance(value, str) and value.startswith("~"):
                node[path[-1]] = os.path.expanduser(value)
    return out


def tiers_as_list(store: dict[str, Any]) -> dict[str, Any]:
    """Tiers may be written as a list or (as env / flags produce) a name -> mapping."""
    store = dict(store)
    tiers = store.get("tiers")
    if isinstance(tiers, dict):
        for name, tier in tiers.items():
            if not isinstance(tier, dict):
                raise ConfigError(f"store.tiers.{name}: must be a mapping of tier settings")
        store["tiers"] = [dict(t, name=name) for name, t in tiers.items()]
    return store


def set_path(data: dict[str, Any], dotted: str, value: Any, *, source: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{source}: empty setting name")
    if parts[:2] == ["store", "tiers"]:
        if len(parts) != 4:
            raise ConfigError(f"{source}: tier settings are store.tiers.<name>.<key>")
        tiers = _tier_map(data.setdefault("store", {}))
        tiers.setdefault(parts[2], {"kind": parts[2]})[parts[3]] = value
        return
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is not a section")
    node[parts[-1]] = value


def _tier_map(store: dict[str, Any]) -> dict[str, Any]:
    """The store's tiers as name -> mapping (converted in place; defaults if absent)."""
    tiers = store.get("tiers")
    if tiers is None:
        tiers = [
            {"kind": t.kind.value, "capacity": t.capacity, "name": t.name} for t in default_tiers()
        ]
    if isinstance(tiers, list):
        mapping: dict[str, Any] = {}
        for i, entry in enumerate(tiers):
            if not isinstance(entry, dict):
                raise ConfigError(f"store.tiers[{i}]: must be a mapping")
            tier = dict(entry)
            mapping[str(tier.pop("name", tier.get("kind")))] = tier
        tiers = mapping
    if not isinstance(tiers, dict):
        raise ConfigError("store.tiers: must be a list of tier mappings")
    store["tiers"] = tiers
    return tiers


def scalar(text: str) -> Any:
    """An environment or flag value as YAML reads it (a string when it is not a scalar)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (str, int, float, bool, dict)) or value is None else text
