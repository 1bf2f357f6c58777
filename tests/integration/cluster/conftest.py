"""Reuse the unit suite's redis-server fixtures (test dirs are not importable packages)."""

import importlib.util
from pathlib import Path

_path = Path(__file__).parents[2] / "unit" / "cluster" / "conftest.py"
_spec = importlib.util.spec_from_file_location("kvf_cluster_fixtures", _path)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

RedisServer = _fixtures.RedisServer
redis_server = _fixtures.redis_server
