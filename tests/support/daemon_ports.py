"""Where a test daemon listens, found from outside the process (/proc), for ports the ready
file does not list."""

from __future__ import annotations

import os
from pathlib import Path


def transport_port(daemon) -> int:
    """The daemon's listening TCP port that is neither its control nor its HTTP port (the
    peer transport's)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    (port,) = ports - {daemon.info["tcp_port"], daemon.info["http_port"]}
    return port
