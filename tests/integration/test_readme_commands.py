"""Every shell command in the README, walked: run for real where it can run here, checked as
far as it can be where it cannot, and the test fails on a command it does not know.

The commands are those of the README's ``bash`` blocks and its inline code spans that start
with a program (tests/support/readme_shell.py finds them: continuations joined, comments
dropped, ``&&`` lists split). Each gets one ``Check``:

- ``RUN``: ``.venv/bin/kvfabric ...``, ``curl ...`` and ``export ...`` lines run as written,
  in README order, by bash in a sandbox directory where the README's relative paths hold
  (``.venv`` is the environment running the tests, ``configs`` the repository's) and ``~`` is
  a fresh home. A ``serve`` keeps running until the next one (Ctrl-C, SIGINT, must stop it
  with exit 0); a ``curl`` goes to the daemon running then and must get HTTP 200; an
  ``export`` line must let ``kvfabric status`` reach that daemon. The one change to the
  commands: each ``serve`` gets ``KVFABRIC_HTTP__PORT`` (a free port; the README's 8790 may
  be taken on a shared host) and each ``curl`` that port in place of 8790.
- ``QUICKSTART``: the put / lookup / status block, run twice by test_readme_quickstart.py.
- ``PARSE``: ``kvfabric ...`` in prose (placeholders such as ``FILE``, usage synopses): the
  CLI's own parser accepts it. Every RUN and QUICKSTART kvfabric command is parsed too.
- ``BENCHMARK``: the script exists and its argument parser accepts the flags; the benchmark
  itself is not run (minutes).
- ``EXTRAS``: ``pip install '.[extra]'`` is not run, but each extra it names exists.
- ``ROUTER``: ``vllm-router ...`` (it would wait for engines): vllm-router's own argument
  parser (``vllm_router.launch_router.parse_router_args``) accepts it.
- ``NOT_RUN``: listed below with the reason; JSON arguments of those lines must parse.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from child_process import free_port
from readme_shell import ShellCommand, quickstart_block, readme_commands, split_shell

from kvfabric.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
PYTHONS = frozenset({"python", "python3", ".venv/bin/python"})

# Commands the walker does not run, by leading words, and why. A README command matching
# none of these and no other check fails test_every_readme_command_is_checked, so a new
# README command must be handled here or by a check; an entry no README command uses fails
# test_every_not_run_entry_is_used, so the list cannot rot.
NOT_RUN: dict[tuple[str, ...], str] = {
    ("python3", "-m", "venv"): "makes a virtual environment; this test runs in one already",
    (".venv/bin/pip", "install"): "installs the package (network, minutes): tests/run.sh does",
    ("pip", "install"): "installs third-party packages (network, minutes): tests/run.sh does",
    ("pip", "uninstall"): "would remove packages from the environment the suite runs in",
    ("bash", "tests/run.sh"): "runs the whole suite, of which this test is part",
    ("bash", "tests/lint.sh"): "CI runs it before the suite (.ci/run); a test must not "
    "depend on the tree being lint-clean while someone edits it",
    (".venv/bin/pre-commit", "install"): "writes a hook into the checkout's .git/hooks",
    (".venv/bin/python", "-m", "pytest"): "runs tests/chaos (minutes, root for its disk "
    "faults): part of tests/run.sh",
    (
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ): "starts a vLLM engine on a model (minutes); tests/e2e/vllm runs engines this way",
    ("vllm", "serve"): "the GPU build's vLLM CLI: needs a GPU",
    ("redis-server",): "a Redis for the README's cluster; tests start their own on a random "
    "loopback port (tests/support/redis_process.py)",
    ("python", "tests/models/build_tiny_llama.py"): "builds the tests' tiny model (a minute); "
    "tests/e2e/conftest.py builds it the same way",
    (
        "python",
        "-m",
        "sglang.launch_server",
    ): "full SGLang needs a CUDA torch; tests/integration/sglang runs the backend",
    ("docker", "build"): "builds a container image: no container builder here; "
    "tests/integration/deploy lints the Dockerfiles and runs what the image runs",
    ("helm",): "installs need a Kubernetes cluster; tests/integration/deploy runs helm lint "
    "and helm template on the chart",
    ("kubectl",): "needs a Kubernetes cluster; tests/integration/deploy validates the manifests",
    ("bash", "deploy/check.sh"): "tests/integration/deploy/test_manifests.py runs it",
    ("bash", "deploy/render-manifests.sh"): "rewrites daemons/kubernetes/; "
    "tests/integration/deploy/test_manifests.py checks the files equal its output",
}


class Check(enum.Enum):
    RUN = "run for real, in README order"
    QUICKSTART = "run by test_readme_quickstart.py"
    PARSE = "accepted by the CLI's parser"
    BENCHMARK = "accepted by the benchmark's parser"
    EXTRAS = "its extras exist in pyproject.toml"
    ROUTER = "accepted by vllm-router's parser"
    NOT_RUN = "in NOT_RUN"


def check_of(command: ShellCommand) -> Check | None:
    """How the walker checks ``command``; None: it does not know the command."""
    argv = command.argv
    if not argv:  # assignments alone
        return None
    if command.block == quickstart_block().line:
        return Check.QUICKSTART
    if argv[0] in (".venv/bin/kvfabric", "curl", "export"):
        return Check.RUN
    if argv[0] == "kvfabric":
        return Check.PARSE
    if argv[0] in PYTHONS and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        return Check.BENCHMARK
    if argv[0].endswith("pip") and argv[1:2] == ("install",) and any(".[" in a for a in argv):
        return Check.EXTRAS
    if argv[0] == "vllm-router":
        return Check.ROUTER
    if not_run_entry(argv) is not None:
        return Check.NOT_RUN
    return None


def not_run_entry(argv: tuple[str, ...]) -> tuple[str, ...] | None:
    return next((words for words in NOT_RUN if argv[: len(words)] == words), None)


def commands_with(check: Check) -> list[ShellCommand]:
    return [command for command in readme_commands() if check_of(command) is check]


def where(command: ShellCommand) -> str:
    return f"README.md:{command.line}: {command.text}"


def test_readme_walker_splits_like_bash() -> None:
    """Would have caught a walker that ran a continued line as two commands, kept a trailing
    comment as arguments, cut a quoted JSON argument spanning lines, or ran `a && b` as one
    command."""
    block = (
        "A=1 cmd --x \\\n  --y 'multi\nline # not a comment' # a comment\n"
        "# a whole-line comment\nfirst && second; third\n"
    )
    assert split_shell(block) == [
        (0, "A=1 cmd --x    --y 'multi\nline # not a comment'"),
        (4, "first"),
        (4, "second"),
        (4, "third"),
    ]
    command = ShellCommand(1, split_shell(block)[0][1], 1)
    assert command.argv == ("cmd", "--x", "--y", "multi\nline # not a comment")


def test_every_readme_command_is_checked() -> None:
    """Fails on a README command the walker neither checks nor lists in NOT_RUN (a new
    command in the README must be handled), and when it finds far fewer commands than the
    README holds (a walker that found nothing would pass everything)."""
    commands = readme_commands()
    unchecked = [where(command) for command in commands if check_of(command) is None]
    assert not unchecked, "README commands neither checked nor in NOT_RUN:\n" + "\n".join(unchecked)
    assert len(commands) >= 25, [where(command) for command in commands]


def test_every_not_run_entry_is_used() -> None:
    """An entry for a command the README no longer shows would let that command come back
    unchecked."""
    used = {not_run_entry(command.argv) for command in commands_with(Check.NOT_RUN)}
    assert set(NOT_RUN) <= used, set(NOT_RUN) - used


def test_not_run_commands_json_arguments_parse() -> None:
    """The engine lines are not run, but a missing comma or brace in their JSON
    (--kv-transfer-config, --hicache-storage-backend-extra-config) would break them."""
    arguments = [
        (command, arg)
        for command in commands_with(Check.NOT_RUN)
        for arg in command.argv
        if arg.startswith("{")
    ]
    assert len(arguments) >= 3
    for command, arg in arguments:
        try:
            json.loads(arg)
        except json.JSONDecodeError as exc:
            pytest.fail(f"{where(command)}\n  bad JSON argument: {exc}")


def test_kvfabric_commands_parse() -> None:
    """Every `kvfabric ...` in the README, placeholders and synopses included, is a command
    and options the CLI knows (a renamed option or subcommand would fail here)."""
    commands = [c for c in readme_commands() if c.argv[0].endswith("kvfabric")]
    assert len(commands) >= 10
    for command in commands:
        # a synopsis (`serve [--config FILE] [--set KEY=VALUE ...]`): its options as given
        argv = [a.strip("[]") for a in command.argv[1:] if a.strip("[]") not in ("", "...")]
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0 and {"--version", "--help"} & set(argv):
                continue  # argparse's own actions: they print and exit 0
            pytest.fail(f"{where(command)}\n  exit {exc.code}: {errors.getvalue()}")


def test_vllm_router_commands_parse() -> None:
    """The router lines are not run (they wait for engines), but a flag vllm-router 0.1.17
    does not know, or a PD setup it rejects, would break them."""
    from vllm_router.launch_router import parse_router_args

    commands = commands_with(Check.ROUTER)
    assert commands
    for command in commands:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                args = parse_router_args(list(command.argv[1:]))
        except SystemExit as exc:
            pytest.fail(f"{where(command)}\n  exit {exc.code}: {errors.getvalue()}")
        if args.vllm_pd_disaggregation:
            assert args.prefill_urls and args.decode_urls, where(command)
            assert args.kv_connector == "nixl", where(command)  # the one kvfabric works with


def test_pip_extras_exist() -> None:
    """`pip install -e '.[x]'` fails on a fresh clone when pyproject.toml has no extra x."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for command in commands_with(Check.EXTRAS):
        for arg in command.argv:
            if ".[" in arg:
                named = arg[arg.index("[") + 1 : arg.rindex("]")].split(",")
                assert set(named) <= set(extras), f"{where(command)}: extras {extras.keys()}"


# The benchmark's own main(), stopped right after its parse_args: the flags are checked by
# the script's real parser (types and values included) without running the benchmark.
PARSE_ONLY = """\
import argparse, json, os, runpy, sys
parse_args = argparse.ArgumentParser.parse_args
def parse_and_stop(parser, args=None, namespace=None):
    print(json.dumps(vars(parse_args(parser, args, namespace)), default=str))
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
sys.exit("the script never called ArgumentParser.parse_args")
"""


def test_benchmark_commands_parse() -> None:
    """A benchmark command with a flag its script no longer takes (or a value of the wrong
    type, or a script that moved) fails here instead of after a fresh clone's setup."""
    commands = commands_with(Check.BENCHMARK)
    assert len(commands) >= 7
    for command in commands:
        script, flags = command.argv[1], command.argv[2:]
        assert (REPO / script).is_file(), where(command)
        done = subprocess.run(
            [sys.executable, "-c", PARSE_ONLY, script, *flags],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"{where(command)}\n{done.stderr[-2000:]}"
        parsed = json.loads(done.stdout.strip().splitlines()[-1])
        for flag in (f for f in flags if f.startswith("--")):
            assert flag[2:].replace("-", "_") in parsed, f"{where(command)}: {flag}"


class Sandbox:
    """A fresh clone's view for the README's commands: cwd with .venv and configs, a home of
    its own, no KVFABRIC_* settings from outside; the daemon a `serve` left running."""

    def __init__(self, root: Path) -> None:
        self.root, self.home = root, root / "home"
        self.home.mkdir()
        venv = Path(sys.executable).parent.parent
        assert (venv / "bin" / "kvfabric").exists(), f"no kvfabric script in {venv}/bin"
        (root / ".venv").symlink_to(venv)
        (root / "configs").symlink_to(REPO / "configs")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
        self.env["HOME"] = str(self.home)
        self.daemon: subprocess.Popen | None = None
        self.http_port = 0
        self.started = 0

    def run(self, command: ShellCommand, then: str = "") -> subprocess.CompletedProcess:
        env = self.env
        if command.argv[1:2] == ("serve",):
            env = env | {"KVFABRIC_HTTP__PORT": str(free_port())}
        return subprocess.run(
            ["bash", "-c", command.text + then],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def serve(self, command: ShellCommand) -> None:
        """Start a `serve` in the background (stopping the one before) and wait for /readyz."""
        self.stop()
        self.http_port = free_port()
        self.started += 1
        log = open(self.root / f"serve-{self.started}.log", "wb")
        self.daemon = subprocess.Popen(
            ["bash", "-c", command.text],
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env | {"KVFABRIC_HTTP__PORT": str(self.http_port)},
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.daemon.poll() is not None:
                pytest.fail(f"{where(command)}\n  exited {self.daemon.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/readyz", timeout=1
                ) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"{where(command)}: not ready\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> None:
        """Ctrl-C the running daemon: the README says that stops it cleanly (exit 0)."""
        if self.daemon is None:
            return
        os.killpg(self.daemon.pid, signal.SIGINT)  # the daemon's own group, as a terminal would
        try:
            code = self.daemon.wait(30)
        finally:
            self.kill()  # one that ignored Ctrl-C
        self.daemon = None
        assert code == 0, f"Ctrl-C: exit {code}\n{self.log()}"

    def kill(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait(10)

    def log(self) -> str:
        return (self.root / f"serve-{self.started}.log").read_text(errors="replace")[-3000:]


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    # short: the dev config's socket lives under ~, and a Unix socket path has 107 bytes
    root = Path(tempfile.mkdtemp(prefix="kvf-readme-"))
    box = Sandbox(root)
    try:
        yield box
    finally:
        box.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_readme_commands_run_in_order(sandbox: Sandbox) -> None:
    """The README's runnable commands, as written, in order: `serve` on the embedded
    defaults, `curl` of its stats, `demo`, `token new`, `serve --config configs/dev.yaml`
    with and without `--check`, and the clients' `export` line. Would have caught a command
    that exits non-zero, a daemon that does not come up or does not stop cleanly on Ctrl-C,
    a stats URL that is not 200 JSON, and an export line (socket path, token) with which
    the CLI cannot reach the daemon it belongs to."""
    commands = commands_with(Check.RUN)
    assert {c.argv[0] for c in commands} == {".venv/bin/kvfabric", "curl", "export"}
    for command in commands:
        argv = command.argv
        if argv[0] == "curl":
            assert sandbox.daemon is not None, f"{where(command)}: no daemon is running"
            assert ":8790" in command.text, f"{where(command)}: which daemon is this for?"
            url_argv = [a.replace(":8790", f":{sandbox.http_port}") for a in argv]
            done = subprocess.run(
                [*url_argv, "-w", "\n%{http_code}"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            body, _, code = done.stdout.rpartition("\n")
            assert (done.returncode, code) == (0, "200"), f"{where(command)}\n{done.stdout}"
            assert "tiers" in json.loads(body), body
        elif argv[0] == "export":
            # what the clients' shell would run next: the CLI must reach the daemon with it
            done = sandbox.run(command, then=" && exec .venv/bin/kvfabric status")
            assert done.returncode == 0, f"{where(command)}\n{done.stdout}{done.stderr}"
            assert sandbox.daemon is not None and "kvfabric node" in done.stdout, done.stdout
        elif argv[1] == "serve" and not {"--check", "--print-config", "--help"} & set(argv):
            sandbox.serve(command)
        else:
            done = sandbox.run(command)
            assert done.returncode == 0, f"{where(command)}\n{done.stdout}{done.stderr}"
    sandbox.stop()
