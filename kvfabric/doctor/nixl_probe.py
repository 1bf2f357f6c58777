"""What NIXL and UCX offer on this node, probed in a child process.

Contract: ``python -m kvfabric.doctor.nixl_probe`` prints one line ``MARKER {json}`` (last
on stdout) with: ``module`` (the NIXL API the daemon's transport would use: ``nixl._api``,
else ``nixl_cu12._api``, the first that imports; "" when neither), ``version``,
``import_error``, ``agent_error`` (creating a NIXL agent with the UCX backend, as the daemon
does; "" when it works), ``ucx_version`` and ``resources`` (UCX's transports as
``transport/device``, from ``ucp_context_print_info`` of the UCX library that NIXL ships,
honouring ``UCX_TLS``), ``ucx_error``.

Why a child: NIXL configures its loggers onto stdout (``--json`` must stay one object), its
native code may print there too, and a UCX library whose ABI differs from what this probe
assumes may crash: the child's death is then a finding, not the doctor's. Only the standard
library is imported here, so the child starts fast.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Any

MARKER = "KVFABRIC-DOCTOR-NIXL"
# (module, distribution), in the order the daemon's transport tries them: NIXL's own meta
# package serves its CUDA variant as nixl._api; a --no-deps nixl-cu12 install (CPU hosts)
# only as nixl_cu12._api
MODULES = (("nixl._api", "nixl"), ("nixl_cu12._api", "nixl-cu12"))
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s*(\S+)")


def probe() -> dict[str, Any]:
    out: dict[str, Any] = {
        "module": "",
        "version": "",
        "import_error": "",
        "agent_error": "",
        "ucx_version": "",
        "resources": [],
        "ucx_error": "",
    }
    errors = []
    module: Any = None
    for name, dist in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a variant picker failing on this torch
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        out["module"] = name
        try:
            out["version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out["version"] = str(getattr(module, "__version__", ""))
        break
    if module is None:
        out["import_error"] = "; ".join(errors)
        return out
    try:
        module.nixl_agent("kvfabric-doctor", module.nixl_agent_config(backends=["UCX"]))
    except Exception as exc:  # no UCX plugin, missing native libraries, ...
        out["agent_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["ucx_version"], out["resources"] = _ucx_resources(_libucp(module))
    except Exception as exc:
        out["ucx_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _libucp(module: Any) -> str:
    """The UCX library NIXL's wheel bundles (``<package>.libs/libucp-*.so*``), else the
    system's."""
    package = Path(module.__file__).parent
    for libs in (package.parent / f"{package.name}.libs", package / "lib"):
        found = sorted(libs.glob("libucp*.so*")) if libs.is_dir() else []
        if found:
            return str(found[0])
    system = ctypes.util.find_library("ucp")
    if system is None:
        raise FileNotFoundError("no libucp found")
    return system


def _ucx_resources(path: str) -> tuple[str, list[str]]:
    ucp = ctypes.CDLL(path)
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    version = f"{major.value}.{minor.value}.{release.value}"
    config = ctypes.c_void_p()
    if ucp.ucp_config_read(None, None, ctypes.byref(config)) != 0:
        raise OSError("ucp_config_read failed")
    # ucp_params_t: field_mask, then features; only masked fields are read. Oversized and
    # zeroed so that a newer layout reads nothing past it.
    params = (ctypes.c_uint64 * 64)()
    params[0] = 1  # UCP_PARAM_FIELD_FEATURES
    params[1] = 1 << 1  # UCP_FEATURE_RMA: one-sided GET / PUT, what NIXL asks for
    context = ctypes.c_void_p()
    status = ucp.ucp_init_version(major, minor, params, config, ctypes.byref(context))
    ucp.ucp_config_release(config)
    if status != 0:
        raise OSError(f"ucp_init failed (status {status})")
    libc = ctypes.CDLL(None)
    libc.tmpfile.restype = ctypes.c_void_p
    libc.fileno.argtypes = [ctypes.c_void_p]
    libc.fflush.argtypes = [ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    stream = libc.tmpfile()
    try:
        ucp.ucp_context_print_info(context, ctypes.c_void_p(stream))
        libc.fflush(stream)
        fd = libc.fileno(stream)
        os.lseek(fd, 0, os.SEEK_SET)
        text = b""
        while chunk := os.read(fd, 1 << 16):
            text += chunk
    finally:
        libc.fclose(stream)
        ucp.ucp_cleanup(context)
    return version, _RESOURCE.findall(text.decode(errors="replace"))


def main() -> None:
    print(f"{MARKER} {json.dumps(probe())}", flush=True)


if __name__ == "__main__":
    main()
