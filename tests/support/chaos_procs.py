"""The chaos harness's daemons (:mod:`chaos_harness`): ``kvfabric serve`` children (see
:mod:`daemon_process`, :mod:`child_process`: process groups of their own that die with the
harness) that keep their socket path across restarts, count their incarnations, and speak
HTTP with the admin token. Its redis-server is a :class:`redis_process.RedisServer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import httpx
from daemon_process import DaemonProcess


class Daemon(DaemonProcess):
    """A ``kvfabric serve`` child on ``data_dir``; restarts keep the directory, the socket
    path and the settings (HTTP and TCP ports are new each time: ``http_url`` follows)."""

    def __init__(self, name: str, data_dir: Path, settings: list[str], admin_token: str) -> None:
        super().__init__(data_dir, [f"socket_path={data_dir / 'kvfabric.sock'}", *settings])
        self.name = name
        self.admin_token = admin_token
        self.incarnation = 0
        self.ready = False  # serving (between a start's ready file and the next kill)

    @property
    def socket(self) -> str:
        return str(self.data_dir / "kvfabric.sock")

    def start(self, timeout: float = 90.0) -> Self:
        self.ready = False
        self.incarnation += 1
        super().start(timeout)
        self.ready = True
        return self

    def kill9(self) -> None:
        assert self.child is not None
        self.ready = False
        self.kill()

    def http(
        self,
        method: str,
        path: str,
        *,
        token: str | None = "admin",
        timeout: float = 10,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request (``token="admin"``: the admin token; None: no Authorization)."""
        token = self.admin_token if token == "admin" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(
            method, f"{self.http_url}{path}", headers=headers, timeout=timeout, **kwargs
        )

    def stats(self, timeout: float = 10) -> dict[str, Any]:
        response = self.http("GET", "/v1/stats", timeout=timeout)
        response.raise_for_status()
        return response.json()

    def health(self, timeout: float = 5) -> str:
        return str(self.http("GET", "/healthz", token=None, timeout=timeout).json()["status"])
