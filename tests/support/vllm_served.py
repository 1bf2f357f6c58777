"""Real OpenAI-compatible vLLM servers and a real vllm-router, as test child processes.

`ServedEngine`: ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) on a
loopback port, CPU build, the environment engine_runner.py gives its engines. `Router`: the
``vllm-router`` binary of the vllm-router wheel (tests/install.sh installs it beside python).
Each runs in its own session so `kill` takes its children (vLLM's engine core) with it.
`wait_ready` polls the health endpoint until ``deadline_s``; a child that exits first fails
at once with its log's tail. Used by tests/e2e/vllm/test_behind_router.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from child_process import Child
from prometheus_client.parser import text_string_to_metric_families
from vllm_env import QUIET, engine_env

REPO_ROOT = Path(__file__).resolve().parents[2]
ROUTER_BIN = Path(sys.executable).with_name("vllm-router")

ENGINE_ENV = {**QUIET, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMP_NUM_THREADS": "1"}


def _metric_sum(url: str, name: str, labels: dict[str, str]) -> float:
    """The sum of a Prometheus series over the samples carrying ``labels`` (0 when absent)."""
    text = httpx.get(url, timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@dataclass
class _Served:
    """A server child (child_process.Child: own process group, dies with the test run)
    answering HTTP on ``port``."""

    name: str
    workdir: Path
    port: int
    child: Child | None = None
    started_s: float = 0.0  # wall from spawn to healthy
    _spawned: float = field(default=0.0, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def pid(self) -> int:
        """The server's pid, also its process group's id (its engine core and workers)."""
        assert self.child is not None, f"{self.name} was never started"
        return self.child.pid

    def log_tail(self, limit: int = 6000) -> str:
        return (self.child.tail(limit) if self.child else "") or "<no log>"

    def _spawn(self, args: list[str], env: dict[str, str]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawned = time.monotonic()
        self.child = Child(
            self.name, args, self.log_path, env={**os.environ, **env}, cwd=REPO_ROOT
        ).start()

    def wait_ready(self, deadline_s: float, path: str = "/health") -> float:
        """Seconds from spawn to a 200 on ``path``; fails after ``deadline_s``."""
        assert self.child is not None
        limit = self._spawned + deadline_s
        while time.monotonic() < limit:
            if not self.child.alive:
                code = self.child.kill()
                raise RuntimeError(f"{self.name} exited {code}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    self.started_s = time.monotonic() - self._spawned
                    return self.started_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(
            f"{self.name} not healthy within {deadline_s:.0f}s; log tail:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill(30)


@dataclass
class ServedEngine(_Served):
    def start(
        self,
        model: Path,
        served_name: str,
        kv_transfer_config: dict | None,
        *extra: str,
        env_extra: dict[str, str] | None = None,
    ) -> ServedEngine:
        """``env_extra``: more environment (e.g. ``VLLM_CPU_OMP_THREADS_BIND``: which core its
        compute thread runs on; by default vLLM binds every engine's to the same one)."""
        env = {
            **ENGINE_ENV,
            **(env_extra or {}),
            **engine_env(self.workdir / "scratch"),
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys(
                    [
                        str(REPO_ROOT),
                        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
                    ]
                )
            ),
        }
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--block-size",
            "128",
            "--enforce-eager",
            "--seed",
            "0",
            *extra,
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self._spawn(args, env)
        return self

    def metric(self, name: str) -> float:
        """The sum of a Prometheus series over all its labels (0 when absent)."""
        return _metric_sum(self.url + "/metrics", name, {})


@dataclass
class Router(_Served):
    metrics_port: int = 0

    def start(self, *args: str) -> Router:
        self._spawn(
            [
                str(ROUTER_BIN),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(self.metrics_port),
                *args,
            ],
            {},
        )
        return self

    def metric(self, name: str, **labels: str) -> float:
        return _metric_sum(f"http://127.0.0.1:{self.metrics_port}/metrics", name, labels)
