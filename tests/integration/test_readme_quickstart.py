"""The README's quickstart runs as written against a real daemon: the ``put`` / ``lookup`` /
``status`` block and the engine snippet ("Using the daemon from an engine"), each twice, from
the directory the daemon was started in (so the default socket path is the one in use), with
authentication on and the token made by ``kvfabric token new``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from readme_shell import fenced_blocks, quickstart_block

KVFABRIC = str(Path(sys.executable).parent / "kvfabric")  # what `.venv/bin/kvfabric` is here


def _engine_snippet() -> str:
    return fenced_blocks("python", after="## Using the daemon from an engine")[0].body


def _quickstart_commands() -> list[str]:
    return [line for line in quickstart_block().body.splitlines() if line.strip()]


@pytest.fixture
def quickstart(tmp_path: Path, start_daemon):
    """A daemon on the embedded defaults in ``tmp_path`` (its socket at the default
    ./kvfabric-data/kvfabric.sock from there), auth on; and the clients' environment."""
    token = tmp_path / "admin-token"
    made = subprocess.run(
        [KVFABRIC, "token", "new", str(token)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    start_daemon(f"auth.token_file={token}", data_dir=tmp_path / "kvfabric-data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    return tmp_path, env | {"KVFABRIC_TOKEN": token.read_text().strip()}


def test_engine_snippet_runs_as_written_twice(quickstart) -> None:
    """Regression: on the old code the snippet used undefined names (token,
    prompt_token_ids, kv_of, first_key), another socket than the default, and a second run
    failed with AlreadyExistsError on the partial last chunk."""
    cwd, env = quickstart
    script = cwd / "snippet.py"
    script.write_text(_engine_snippet())
    outputs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    assert outputs == [
        "0 of 1000 tokens were stored already",
        "768 of 1000 tokens were stored already",
    ]


def test_quickstart_commands_show_a_hit(quickstart) -> None:
    """Regression: on the old code nothing in the quickstart stored KV, so status and lookup
    could only show misses (and there was no `kvfabric put`)."""
    cwd, env = quickstart
    outputs = []
    for _ in range(2):
        for line in _quickstart_commands():
            argv = shlex.split(line.replace(".venv/bin/kvfabric", KVFABRIC))
            if "python3" in argv[0]:  # `python3 -c ... > prompt.json`: a shell line
                done = subprocess.run(
                    line,
                    shell=True,
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
            else:
                done = subprocess.run(
                    argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
                )
            assert done.returncode == 0, f"{line}: {done.stderr}"
            outputs.append(done.stdout)
    first_put, first_lookup, status = outputs[1], outputs[2], outputs[3]
    second_put, second_status = outputs[5], outputs[7]
    assert first_put.startswith("stored 4 chunks") and "0 chunks were stored already" in first_put
    assert second_put.startswith("stored 0 chunks") and "4 chunks were stored already" in second_put
    assert first_lookup.startswith("matched 768 / 1000 tokens")
    assert re.search(r"objects 4\b", status), status
    rate = re.search(r"token hit rate ([0-9.]+)%", second_status)
    assert rate is not None and float(rate.group(1)) > 0, second_status
