"""Shared test setup: telemetry off for every library, small specs and namespaces."""

from __future__ import annotations

import os

for _var, _value in {"LMCACHE_TRACK_USAGE": "false", "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_var, _value)
