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

import sys
from pathlib import Path
from typing import Any

import httpx
import yaml
from child_process import free_port
from prometheus_client.parser import text_string_to_metric_families
from vllm_env import QUIET
from vllm_served import _Served

REPO_ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess(_Served):
    """A gateway child on ``config`` (a dict, the gateway's YAML schema), named ``name``."""

    def __init__(self, name: str, workdir: Path, config: dict[str, Any]) -> None:
        super().__init__(name, workdir, free_port())
        self.config = {**config, "host": "127.0.0.1", "port": self.port}

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.yaml"

    def start(self) -> GatewayProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [sys.executable, "-m", "kvfabric.cli", "gateway", "--config", str(self.config_path)]
        self._spawn(argv, QUIET)
        return self

    def wait_ready(self, deadline_s: float, path: str = "/readyz") -> float:
        """Seconds from spawn to a 200 on ``path`` (``/readyz``: an engine is healthy)."""
        return super().wait_ready(deadline_s, path)

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
