"""Peer transport check: is NIXL (UCX) there, and which transport will the daemon use.

Contract: :func:`probe_nixl` runs :mod:`kvfabric.doctor.nixl_probe` in a child process
(bounded by ``timeout``) and returns a :class:`NixlProbe`, never raising;
:func:`check_transport` judges it against the config as ``transport.nixl``:

* ``cluster.index: embedded``: no peer transport is opened; what NIXL offers is info;
* ``cluster.transport: nixl`` (redis index) without a working NIXL agent: error (the daemon
  refuses to start); ``auto`` without it: info (the socket backend is used); with peer TLS
  ``auto`` picks the socket backend anyway (NIXL is not encrypted);
* UCX's transports are listed (``transport/device``); NIXL between nodes without an RDMA
  device moves chunks over TCP, which is said.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from kvfabric.config import DaemonConfig
from kvfabric.doctor.nixl_probe import MARKER
from kvfabric.doctor.result import CheckResult, Severity

PROBE_TIMEOUT_S = 30.0
RDMA_TRANSPORTS = ("rc", "ud", "dc", "rc_verbs", "ud_verbs", "rc_mlx5", "ud_mlx5", "dc_mlx5")
INSTALL = "pip install --no-deps nixl-cu12 (the kvfabric[nixl] extra; it runs without a GPU)"


@dataclass(frozen=True)
class NixlProbe:
    """What the child found; ``failure`` is set when the child itself failed."""

    module: str = ""
    version: str = ""
    import_error: str = ""
    agent_error: str = ""
    ucx_version: str = ""
    resources: tuple[str, ...] = ()
    ucx_error: str = ""
    failure: str = ""

    @property
    def usable(self) -> bool:
        """Whether the daemon's NIXL transport can start here."""
        return bool(self.module) and not self.agent_error

    @property
    def rdma(self) -> bool:
        return any(r.split("/")[0] in RDMA_TRANSPORTS for r in self.resources)

    @property
    def reason(self) -> str:
        """Why NIXL is not usable ("" when it is)."""
        if self.failure:
            return self.failure
        if not self.module:
            return f"NIXL does not import ({self.import_error})"
        return f"a NIXL agent with the UCX backend cannot be created: {self.agent_error}"


def probe_nixl(timeout: float = PROBE_TIMEOUT_S) -> NixlProbe:
    argv = [sys.executable, "-m", "kvfabric.doctor.nixl_probe"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return NixlProbe(failure=f"the NIXL probe did not finish within {timeout:.0f} s")
    except OSError as exc:
        return NixlProbe(failure=f"the NIXL probe could not start: {exc}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER + " "):
            found = json.loads(line[len(MARKER) + 1 :])
            found["resources"] = tuple(found.get("resources", ()))
            return NixlProbe(**{k: v for k, v in found.items() if k in _FIELDS})
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return NixlProbe(
        failure=f"the NIXL probe died (exit {done.returncode}) before reporting: {tail[0]}"
    )


_FIELDS = set(NixlProbe.__dataclass_fields__)


def _offer(found: NixlProbe) -> str:
    if not found.usable:
        return f"NIXL unavailable: {found.reason}"
    text = f"NIXL {found.version} ({found.module}), UCX agent works"
    if found.resources:
        text += f"; UCX {found.ucx_version} transports: {', '.join(found.resources)}"
        if not found.rdma:
            text += " (no RDMA device: between nodes UCX uses TCP)"
    elif found.ucx_error:
        text += f"; UCX transports not listed ({found.ucx_error})"
    return text


def check_transport(config: DaemonConfig, found: NixlProbe) -> CheckResult:
    values: tuple[tuple[str, str | int], ...] = (
        ("nixl", found.version if found.usable else ""),
        ("ucx", found.ucx_version),
        ("ucx_transports", ",".join(found.resources)),
    )
    cluster = config.cluster
    offer = _offer(found)
    if cluster.index != "redis":
        return CheckResult(
            "transport.nixl",
            Severity.INFO,
            f"unused (the embedded index opens no peer transport); {offer}",
            values=values,
        )
    if cluster.transport == "socket":
        return CheckResult(
            "transport.nixl", Severity.INFO, f"socket transport configured; {offer}", values=values
        )
    if config.security.tls_on("peer"):  # the config refuses nixl with it: this is auto
        return CheckResult(
            "transport.nixl",
            Severity.INFO,
            f"peer TLS is on: the socket transport carries chunks (NIXL is not encrypted); {offer}",
            values=values,
        )
    if found.usable:
        return CheckResult("transport.nixl", Severity.OK, offer, values=values)
    if cluster.transport == "nixl":
        return CheckResult(
            "transport.nixl",
            Severity.ERROR,
            f"cluster.transport is nixl, but {offer}: the daemon will not start",
            f"{INSTALL}, or set cluster.transport: auto",
            values,
        )
    return CheckResult(
        "transport.nixl",
        Severity.INFO,
        f"transport auto: the socket backend carries chunks ({offer})",
        f"for NIXL: {INSTALL}",
        values,
    )
