"""A ``kvfabric gateway`` child process for tests.

:class:`GatewayProcess` writes its YAML configuration (``host`` and ``port`` filled in: the
gateway takes no port 0, so a free loopback port is picked here), starts ``python -m
kvfabric.cli gateway --config FILE`` as a :class:`child_process.Child` (a process group of its
own that dies with its parent; output appended to ``workdir/NAME.log``) and waits for a 200 on
``/readyz`` (an engine is healthy) or another path within the caller's deadline; a gateway that
exits first fails at once with its log's tail. :meth:`GatewayProcess.metric` sums a series of
its ``/metrics`` over the samples carrying some labels. Start it from the thread that keeps
running while it should (see :mod:`child_process`). Used by tests/e2e/gateway/.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from child_process import Child, free_port
from prometheus_client.parser import text_string_to_metric_families
from vllm_env import QUIET

REPO_ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess:
    """A gateway child on ``config`` (a dict, the gateway's YAML schema), named ``name``."""

    def __init__(self, name: str, workdir: Path, config: dict[str, Any]) -> None:
        self.name = name
        self.workdir = workdir
        self.port = free_port()
        self.config = {**config, "host": "127.0.0.1", "port": self.port}
        self.child: Child | None = None
        self.started_s = 0.0  # wall from spawn to ready
        self._spawned = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.yaml"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def log_tail(self, limit: int = 6000) -> str:
        return (self.child.tail(limit) if self.child else "") or "<no log>"

    def start(self) -> GatewayProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [sys.executable, "-m", "kvfabric.cli", "gateway", "--config", str(self.config_path)]
        self._spawned = time.monotonic()
        self.child = Child(
            self.name, argv, self.log_path, env={**os.environ, **QUIET}, cwd=REPO_ROOT
        ).start()
        return self

    def wait_ready(self, deadline_s: float, path: str = "/readyz") -> float:
        """Seconds from spawn to a 200 on ``path``; RuntimeError after ``deadline_s`` or when
        the gateway exits first (its log's tail quoted)."""
        assert self.child is not None, f"{self.name} was never started"
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
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(
            f"{self.name} not ready ({path}) within {deadline_s:.0f}s; log tail:\n{self.log_tail()}"
        )

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill(30)

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample of one scrape of ``/metrics``: (name, labels, value)."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        return [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of series ``name`` over the samples carrying ``labels`` (0 when absent)."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples()
            if sample_name == name and labels.items() <= sample_labels.items()
        )
