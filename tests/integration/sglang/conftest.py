"""SGLang's HiCache storage interface, from its wheel, without CUDA.

Full SGLang needs a CUDA torch, so the suite does not install it. It takes the wheel
(``$KVFABRIC_SGLANG_WHEEL``, a file or a directory, by default ``.venv/wheels``; tests/run.sh
downloads it there with ``pip download --no-deps sglang==SGLANG_VERSION``) and unpacks into
``.venv/sglang-storage/<wheel>/`` only the modules the storage interface imports:

- ``sglang/srt/mem_cache/hicache_storage.py`` (``HiCacheStorage``, ``HiCacheStorageConfig``,
  ``HiCacheStorageExtraInfo``), ``sglang/srt/mem_cache/storage/__init__.py`` and
  ``backend_factory.py`` (``StorageBackendFactory``, which creates ``dynamic`` backends),
  ``sglang/srt/environ.py`` (stdlib only) — imported unchanged. ``sglang/__init__.py`` is left
  out: it imports the whole runtime; without it ``sglang`` is a namespace package.

What cannot be imported on a CPU torch, and what stands in for it:

- ``sglang.srt.observability.metrics_collector`` imports model configs
  (``sglang.srt.configs`` -> ``nano_nemotron_vl`` -> ``sglang.srt.multimodal.internvl_utils``
  -> ``torchvision``) and ``sglang.srt.utils.common`` (``orjson``, ``triton``, CUDA platform
  probes). The unpacked copy of that module holds only ``StorageMetrics``, compiled from the
  wheel's own source of that class.
- ``sglang.srt.mem_cache.pool_host`` (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``)
  imports ``sglang.srt.utils`` (as above) and ``sgl_kernel`` transfer kernels. :class:`HostPool`
  allocates ``kv_buffer`` with the dims of the real ``init_kv_buffer`` for each layout, and its
  page methods (``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``)
  are the real pools' own, compiled from the wheel's source.

A missing wheel fails the tests with the command that provides it; it never skips them.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import os
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SGLANG_VERSION = "0.5.23"
WHEEL_ENV = "KVFABRIC_SGLANG_WHEEL"
DEFAULT_WHEEL_DIR = ROOT / ".venv" / "wheels"
CACHE_DIR = ROOT / ".venv" / "sglang-storage"
IMPORTED = (
    "sglang/srt/environ.py",
    "sglang/srt/mem_cache/hicache_storage.py",
    "sglang/srt/mem_cache/storage/__init__.py",
    "sglang/srt/mem_cache/storage/backend_factory.py",
)
METRICS = "sglang/srt/observability/metrics_collector.py"
POOL_SOURCES = {
    "mha": (
        "sglang/srt/mem_cache/pool_host/mha.py",
        "MHATokenToKVPoolHost",
        ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page"),
    ),
    "mla": (
        "sglang/srt/mem_cache/pool_host/mla.py",
        "MLATokenToKVPoolHost",
        (
            "_storage_page_index",
            "get_data_page",
            "get_dummy_flat_data_page",
            "set_from_flat_data_page",
        ),
    ),
}

PROVIDE = f".venv/bin/python -m pip download --no-deps sglang=={SGLANG_VERSION} -d .venv/wheels"


def find_wheel() -> Path:
    configured = os.environ.get(WHEEL_ENV)
    where = Path(configured) if configured else DEFAULT_WHEEL_DIR
    if where.is_file():
        return where
    found = sorted(where.glob(f"sglang-{SGLANG_VERSION}-*.whl")) if where.is_dir() else []
    if not found:
        pytest.fail(
            f"the SGLang wheel is missing (looked for sglang-{SGLANG_VERSION}-*.whl "
            f"in {where}); provide it with `{PROVIDE}` or point ${WHEEL_ENV} at it",
            pytrace=False,
        )
    return found[-1]


def _class_methods(source: str, class_name: str, names: tuple[str, ...]) -> dict[str, str]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    methods = {n.name: ast.unparse(n) for n in cls.body if isinstance(n, ast.FunctionDef)}
    missing = set(names) - set(methods)
    assert not missing, f"{class_name} of this wheel lacks {sorted(missing)}"
    return {name: methods[name] for name in names}


def _storage_metrics_module(source: str) -> str:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StorageMetrics")
    return (
        "# Only StorageMetrics of the wheel's metrics_collector.py (see the conftest of "
        "tests/integration/sglang).\nfrom dataclasses import dataclass, field\n"
        "from typing import List\n\n\n" + ast.unparse(cls) + "\n"
    )


def unpack(wheel: Path) -> Path:
    """The wheel's storage modules under the cache dir (unpacked once per wheel)."""
    target = CACHE_DIR / wheel.stem
    if (target / "COMPLETE").exists():
        return target
    staging = CACHE_DIR / f".{wheel.stem}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        for name in IMPORTED:
            archive.extract(name, staging)
        metrics = staging / METRICS
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text(_storage_metrics_module(archive.read(METRICS).decode()))
        for kind, (path, class_name, names) in POOL_SOURCES.items():
            methods = _class_methods(archive.read(path).decode(), class_name, names)
            (staging / f"pool_methods_{kind}.py").write_text("\n\n".join(methods.values()))
    (staging / "COMPLETE").write_text(wheel.name + "\n")
    try:
        staging.rename(target)
    except OSError:  # another process unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


_unpacked: Path | None = None


def sglang_dir() -> Path:
    """Unpack (once) and put the storage modules first on sys.path."""
    global _unpacked
    if _unpacked is None:
        _unpacked = unpack(find_wheel())
        sys.path.insert(0, str(_unpacked))
    return _unpacked


@pytest.fixture(scope="session")
def sglang_storage() -> Any:
    """``sglang.srt.mem_cache.hicache_storage`` from the wheel."""
    sglang_dir()
    import sglang.srt.mem_cache.hicache_storage as module

    return module


@pytest.fixture(scope="session")
def storage_factory(sglang_storage: Any) -> Any:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return StorageBackendFactory


def _pool_methods(kind: str) -> dict[str, Callable[..., Any]]:
    source = (sglang_dir() / f"pool_methods_{kind}.py").read_text()
    namespace: dict[str, Any] = {"torch": torch}
    code = compile(
        source,
        f"<sglang {POOL_SOURCES[kind][0]}>",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    return {name: namespace[name] for name in POOL_SOURCES[kind][2]}


class HostPool:
    """SGLang's host KV pool as its HiCache storage backends see it, on the CPU.

    ``kv_buffer`` has the dims of ``MHATokenToKVPoolHost.init_kv_buffer`` /
    ``MLATokenToKVPoolHost.init_kv_buffer`` (sglang 0.5.23) for ``layout``; the page methods
    are SGLang's own. ``size`` token slots in ``size // page_size`` pages.
    """

    device = "cpu"
    pin_memory = False
    dcp_size = 1

    def __init__(
        self,
        *,
        layout: str,
        mla: bool = False,
        layer_num: int = 3,
        head_num: int = 2,
        head_dim: int = 16,
        page_size: int = 4,
        pages: int = 16,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout, self.layer_num, self.page_size, self.dtype = (
            layout,
            layer_num,
            page_size,
            dtype,
        )
        self.size, self.page_num = pages * page_size, pages
        self.logical_page_size, self.logical_size = page_size, self.size
        if mla:
            self.kv_cache_dim = head_dim
            dims = {
                "layer_first": (layer_num, self.size, 1, head_dim),
                "page_first": (self.size, layer_num, 1, head_dim),
                "page_first_direct": (pages, layer_num, page_size, 1, head_dim),
            }
        else:
            self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
            dims = {
                "layer_first": (2, layer_num, self.size, head_num, head_dim),
                "page_first": (2, self.size, layer_num, head_num, head_dim),
                "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
                "page_head": (2, pages, head_num, page_size, layer_num, head_dim),
            }
        self.kv_buffer = torch.zeros(dims[layout], dtype=dtype)
        for name, method in _pool_methods("mla" if mla else "mha").items():
            setattr(self, name, method.__get__(self))

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=generator))

    def page_bytes(self, start: int) -> bytes:
        """One page, flat in this pool's own order (SGLang's ``get_data_page``)."""
        return self.get_data_page(start).contiguous().view(torch.uint8).numpy().tobytes()

    def host_indices(self, pages: list[int]) -> torch.Tensor:
        """The token slots of ``pages`` as SGLang's cache controller passes them."""
        return torch.cat(
            [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        ).to(torch.int64)


def page_hashes(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """Page keys shaped like SGLang's: a SHA-256 chain over each page's uint32 token ids."""
    out, digest = [], bytes.fromhex(prior) if prior else b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256(digest + struct.pack(f"<{len(page)}I", *page)).digest()
        out.append(digest.hex())
    return out


@pytest.fixture(scope="session")
def make_pool(sglang_storage: Any) -> Callable[..., HostPool]:
    """make_pool(layout=..., mla=False, **geometry) -> a :class:`HostPool`."""
    return HostPool


@pytest.fixture(scope="session")
def page_keys() -> Callable[..., list[str]]:
    return page_hashes


@pytest.fixture
def make_backend(sglang_storage: Any, storage_factory: Any) -> Any:
    """make_backend(pool, socket, tp_rank=0, tp_size=1, **extra) -> a registered backend,
    made by SGLang's factory as its cache controller does."""
    made: list[Any] = []

    def make(
        pool: HostPool,
        socket: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        model_name: str = "test-model",
        mla: bool = False,
        **extra: Any,
    ) -> Any:
        config = sglang_storage.HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=mla,
            enable_storage_metrics=True,
            is_page_first_layout=pool.layout.startswith("page_first"),
            model_name=model_name,
            extra_config={
                "backend_name": "kvfabric",
                "module_path": "kvfabric_connectors.sglang",
                "class_name": "KVFabricHiCacheStorage",
                "interface_v1": 1,
                "socket_path": socket,
                "timeout_s": 5.0,
                **extra,
            },
        )
        backend = storage_factory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
