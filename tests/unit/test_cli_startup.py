"""The command line starts fast and speaks plain text: ``--help`` and the client commands load
no heavy module, start within a bound derived from this interpreter's own start, and every
subcommand describes itself without reST markup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfabric.commands import lookup
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, AttentionKind

# What `--help` must never pay for: the array stack, engines, the HTTP server, Redis, the
# store and the daemon.
HEAVY = (
    "numpy",
    "torch",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "redis",
    "msgpack",
    "xxhash",
    "yaml",
    "asyncio",
    "kvfabric.client",
    "kvfabric.store.store",
    "kvfabric.server",
    "kvfabric.spec",
    "kvfabric.hashing",
)
# What a client command (status, lookup) may load, but never these.
SERVER_SIDE = (
    "torch",
    "fastapi",
    "uvicorn",
    "starlette",
    "redis",
    "kvfabric.server",
    "kvfabric.store.store",
    "kvfabric.api",
)
STARTUP_MARGIN_S = 0.3  # over `python -c pass` on the same machine, best of a few runs
COMMANDS = ("serve", "status", "lookup", "put", "demo", "token", "bench")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}


def _loaded_after(*argv: str) -> tuple[set[str], int]:
    """Modules loaded by ``kvfabric <argv>`` (run in a fresh interpreter) and its exit code."""
    code = (
        "import sys, json\n"
        "from kvfabric.cli import main\n"
        "try:\n"
        f"    rc = main({list(argv)!r})\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n"
        "print('\\n' + json.dumps([sorted(sys.modules), rc]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    modules, rc = json.loads(done.stdout.strip().splitlines()[-1])
    return set(modules), int(rc or 0)


def _heavy(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("--version",), *((c, "--help") for c in COMMANDS), ("token", "new", "--help")],
    ids=" ".join,
)
def test_help_loads_no_heavy_module(argv: tuple[str, ...]) -> None:
    """Regression: on the old code importing kvfabric.cli loaded numpy, the client, the store
    and asyncio (1.4-1.8 s per call on a loaded machine) before parsing a flag."""
    modules, rc = _loaded_after(*argv)
    assert rc == 0
    assert _heavy(modules, HEAVY) == []


def test_client_commands_load_no_server_side_module(tmp_path: Path) -> None:
    """``status`` and ``lookup`` load the client (numpy) to talk to the daemon, never the
    store, the HTTP server, torch or redis (here against a socket nobody serves: exit 1)."""
    for argv in (
        ("status", "--socket", str(tmp_path / "none.sock")),
        (
            "lookup",
            "--socket",
            str(tmp_path / "none.sock"),
            "--model",
            "m",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--tokens",
            "1 2",
        ),
    ):
        modules, rc = _loaded_after(*argv)
        assert rc == 1
        assert "kvfabric.client" in modules
        assert _heavy(modules, SERVER_SIDE) == []


def _best_of(argv: list[str], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, timeout=120, env=_env(), check=True)
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize(
    "argv", [("--help",), ("status", "--help"), ("lookup", "--help")], ids=" ".join
)
def test_help_starts_within_a_bound_of_the_interpreters_own_start(argv: tuple[str, ...]) -> None:
    """Regression: on the old code `kvfabric --help` took 1.4-1.8 s; the bound is this
    machine's `python -c pass` + 0.3 s (best of 3 each, interleaved, so load hits both)."""
    base, cli = float("inf"), float("inf")
    for _ in range(3):
        base = min(base, _best_of([sys.executable, "-c", "pass"], 1))
        cli = min(cli, _best_of([sys.executable, "-m", "kvfabric.cli", *argv], 1))
    assert cli <= base + STARTUP_MARGIN_S, f"{cli:.3f} s vs python -c pass {base:.3f} s"


def test_version_prints_the_one_version_the_package_has() -> None:
    """``kvfabric --version``: the package's ``__version__``, which is also the installed
    distribution's version (pyproject.toml reads it from kvfabric/__init__.py)."""
    from importlib.metadata import version

    import kvfabric

    done = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=True,
    )
    assert done.stdout == f"kvfabric {kvfabric.__version__}\n"
    assert version("kvfabric") == kvfabric.__version__


def _help(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize(
    "argv",
    [(), *((c,) for c in COMMANDS), ("token", "new")],
    ids=lambda a: " ".join(a) or "kvfabric",
)
def test_help_is_plain_text_with_a_description(argv: tuple[str, ...]) -> None:
    """Regression: on the old code `kvfabric --help` printed ``kvfabric`` (reST) and the
    subcommands had no description."""
    text = _help(*argv)
    assert "``" not in text and ":mod:" not in text and ":class:" not in text
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith("usage: kvfabric")
    description = rest.split("\n\n")[0]
    assert len(description.split()) >= 10, f"no description: {text[:400]}"


def test_lookup_flag_constants_match_the_spec() -> None:
    """The lookup flags spell out kvfabric.spec's values so --help need not import numpy."""
    assert tuple(k.value for k in AttentionKind) == lookup.ATTENTION_KINDS
    assert lookup.DEFAULT_CHUNK_TOKENS == DEFAULT_CHUNK_TOKENS


def test_demo_says_when_it_skips_the_device_tier(tmp_path: Path) -> None:
    """Regression: on the old code the demo skipped the device tier silently without torch
    (here torch is made unimportable in the child)."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # `import torch` raises ImportError\n"
        "from kvfabric.cli import main\n"
        f"sys.exit(main(['demo', '--data-dir', {str(tmp_path / 'demo')!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "device tier skipped: torch is not installed" in done.stdout
    assert "demo OK" in done.stdout
