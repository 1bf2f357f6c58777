"""``examples/kv_event_consumer.py`` as a user runs it: ``--help``, bad arguments, and a real
run against a redis-server until ``--max-events`` events were applied."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvfabric.cluster import ChunkRecord, NodeInfo
from kvfabric.cluster.redis_index import RedisGlobalIndex
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.spec import KVSpec, Namespace

EXAMPLE = Path(__file__).parents[3] / "examples" / "kv_event_consumer.py"
NS = Namespace("model-a", KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4))
CHAIN = chunk_keys(NS, list(range(12)))


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_help_prints_usage_and_exits_0() -> None:
    """Regression: on the old code ``--help`` crashed with ``main() missing 1 required
    positional argument`` (sys.argv[1:3] was splatted into main(url, state_file))."""
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "state_file" in done.stdout and "--max-events" in done.stdout
    assert "Traceback" not in done.stderr


def test_missing_arguments_exit_2_with_usage() -> None:
    """Regression: on the old code no arguments gave a TypeError traceback."""
    done = _run()
    assert done.returncode == 2
    assert "usage:" in done.stderr and "Traceback" not in done.stderr


def test_follows_the_stream_of_a_real_index(redis_server, tmp_path: Path) -> None:
    producer = RedisGlobalIndex(redis_server.url)
    try:
        producer.register(NodeInfo("n1", "10.0.0.1:7000", ("dram",)))
        producer.publish(stored=[ChunkRecord(NS.seed, CHAIN[0], "dram", ROOT, 4)])
        producer.flush()
        consumer = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                redis_server.url,
                str(tmp_path / "state.id"),
                "--max-events",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert consumer.stdout is not None
            first = consumer.stdout.readline()  # started from the snapshot: one chunk known
            assert "1 chunks known" in first, first
            producer.publish(stored=[ChunkRecord(NS.seed, CHAIN[1], "dram", CHAIN[0], 4)])
            producer.flush()
            out, err = consumer.communicate(timeout=60)
        finally:
            consumer.kill()
        assert consumer.returncode == 0, err
        assert " stored n1 dram 1" in out
        assert (tmp_path / "state.id").read_text().strip()  # the applied event's id is saved
    finally:
        producer.close()
