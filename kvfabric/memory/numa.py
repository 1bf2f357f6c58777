"""NUMA placement of arena memory (how a "cxl" tier lands on a CPU-less memory node).

:func:`bind` applies ``mbind(MPOL_BIND)`` to a mapping before it is touched, so its pages
are allocated on the requested node. Without such a node, or where the kernel refuses, the
memory stays where the kernel puts it and a warning says so: a CXL tier then behaves like
DRAM with a different configured cost, which is the documented degraded mode.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from pathlib import Path

log = logging.getLogger(__name__)

_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_BIND = 2
_MPOL_MF_STRICT = 1
_NODE_ROOT = Path("/sys/devices/system/node")


def available_nodes() -> list[int]:
    """NUMA node ids this machine exposes (``[0]`` where sysfs says nothing)."""
    try:
        nodes = sorted(
            int(m.group(1))
            for p in _NODE_ROOT.iterdir()
            if (m := re.fullmatch(r"node(\d+)", p.name))
        )
    except OSError:
        return [0]
    return nodes or [0]


def bind(address: int, length: int, node: int) -> bool:
    """Bind ``[address, address+length)`` to ``node``; ``False`` (with a warning) if it can't."""
    if node not in available_nodes():
        log.warning(
            "NUMA node %d does not exist (nodes: %s); tier memory is not bound and "
            "behaves like plain DRAM",
            node,
            available_nodes(),
        )
        return False
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        log.warning("mbind is not wired for %s; tier memory is not NUMA-bound", platform.machine())
        return False
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(_MPOL_BIND),
        mask,
        ctypes.c_ulong(len(mask) * bits + 1),
        ctypes.c_uint(_MPOL_MF_STRICT),
    )
    if rc != 0:
        err = ctypes.get_errno()
        log.warning(
            "mbind to NUMA node %d failed (%s); tier memory is not bound", node, os.strerror(err)
        )
        return False
    return True
