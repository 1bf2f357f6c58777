"""The environment of every vLLM CPU engine the tests and benchmarks start.

Telemetry off and offline (no test talks to the network), loopback only, a 1 GiB KV cache,
and scratch directories of the engine's own: vLLM's caches and config, TMPDIR, and zmq's
ipc:// sockets, whose paths must stay under 108 bytes (so under /tmp, not a pytest tmp dir).
Callers add what their engines differ in (threads, the CPU reservation, multiprocessing).
Used by tests/e2e/vllm/engine_runner.py (offline ``LLM`` jobs), vllm_served.py and
chaos_vllm.py (OpenAI servers).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

QUIET = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def engine_env(scratch: Path) -> dict[str, str]:
    """:data:`QUIET` plus scratch directories under ``scratch`` (made here) and a fresh
    short ``VLLM_RPC_BASE_PATH`` under /tmp (the caller removes it when it is done)."""
    dirs = {
        "TMPDIR": scratch / "tmp",
        "VLLM_CACHE_ROOT": scratch / "cache",
        "VLLM_CONFIG_ROOT": scratch / "config",
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    rpc = tempfile.mkdtemp(prefix="vrpc-", dir="/tmp")
    return {**QUIET, **{k: str(v) for k, v in dirs.items()}, "VLLM_RPC_BASE_PATH": rpc}
