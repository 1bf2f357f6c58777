"""``kvfabric demo``: store a prompt's KV through every tier and read it back.

What it shows, on embedded defaults with no external service: a synthetic prompt's KV is
written layer by layer into the fastest tier, pushed down (device -> DRAM -> CXL -> SSD) by
capacity pressure (the device tier needs torch: without it the demo says so and skips
it), found again by a longest-prefix lookup, read back byte-exact (SSD reads are
checksum-verified and promoted), and the SSD part survives a restart of the store.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvfabric.hashing import ChunkRef, chunk_hashes
from kvfabric.memory import numa
from kvfabric.spec import KVDtype, KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.config import KiB, MiB, format_size
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=KVDtype.BFLOAT16, chunk_tokens=256)
NAMESPACE = Namespace("demo/tiny-llama", SPEC, tenant_salt="demo")
PROMPT_CHUNKS = 24


@dataclass(frozen=True)
class DemoResult:
    chunks: int
    verified_first_pass: int
    verified_after_restart: int
    recovered_after_restart: int

    @property
    def ok(self) -> bool:
        return (
            self.verified_first_pass == self.chunks
            and self.verified_after_restart == self.recovered_after_restart > 0
        )


def demo_tiers() -> tuple[TierConfig, ...]:
    """Every tier kind, each holding a few chunks so the prompt has to spread over all."""
    chunk = SPEC.chunk_bytes
    nodes = numa.available_nodes()
    far_node = nodes[-1] if len(nodes) > 1 else None  # plain memory on a one-node machine
    tiers = [
        TierConfig(TierKind.DRAM, 4 * chunk, page_size=64 * KiB),
        TierConfig(TierKind.CXL, 4 * chunk, page_size=64 * KiB, numa_node=far_node),
        TierConfig(TierKind.SSD, 64 * MiB, segment_bytes=16 * MiB),
    ]
    if not torch_available():
        return tuple(tiers)
    return (TierConfig(TierKind.DEVICE, 4 * chunk, page_size=64 * KiB, device="cpu"), *tiers)


def torch_available() -> bool:
    """Whether the device tier can run here (it needs torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


NO_TORCH_NOTE = (
    "device tier skipped: torch is not installed (pip install -e '.[device]' to include it)"
)


def _payload(key: bytes, nbytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def run_demo(data_dir: Path | None = None, *, out: Callable[[str], None] = print) -> DemoResult:
    owned = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="kvfabric-demo-")) if data_dir is None else Path(data_dir)
    tiers = demo_tiers()
    config = StoreConfig(data_dir=str(root), tiers=tiers, maintenance_interval_s=0.05)
    tokens = np.random.default_rng(7).integers(
        0, 32000, PROMPT_CHUNKS * SPEC.chunk_tokens, dtype=np.int32
    )
    refs = chunk_hashes(NAMESPACE, tokens)
    try:
        out(
            f"kvfabric demo: {len(refs)} chunks of {SPEC.chunk_tokens} tokens "
            f"({SPEC.chunk_bytes // KiB} KiB each, {SPEC.num_layers} layers) in {root}"
        )
        if all(t.kind is not TierKind.DEVICE for t in tiers):
            out(NO_TORCH_NOTE)  # said, not silent: the README promises a device tier
        with TieredStore(config) as store:
            started = time.perf_counter()
            for ref in refs:
                data = _payload(ref.key, SPEC.chunk_bytes).reshape(SPEC.num_layers, -1)
                with store.reserve(NAMESPACE, ref.key, parent=ref.parent) as writer:
                    for layer in range(SPEC.num_layers):  # as a prefill would: layer by layer
                        writer.write_layer(layer, data[layer])
                        writer.commit_layer(layer)
            store.flush()
            put_s = time.perf_counter() - started
            hit = store.lookup_tokens(NAMESPACE, tokens)
            out(
                f"stored in {put_s * 1e3:.1f} ms; lookup matched {hit.matched_tokens}/"
                f"{len(tokens)} tokens: "
                + ", ".join(f"{t}={n}" for t, n in hit.tier_tokens.items())
            )
            _print_tiers(store, out)
            verified = _verify(store, refs)
            promoted = sum(t.promotions for t in store.stats().tiers)
            out(
                f"read back {verified}/{len(refs)} chunks byte-exact "
                f"({promoted} promoted on hit, SSD reads checksum-verified)"
            )
        with TieredStore(config) as store:  # restart: memory tiers are gone, SSD is not
            recovered = len(store)
            again = _verify(store, [r for r in refs if store.contains(NAMESPACE, r.key)])
            out(f"after restart: {recovered} chunks recovered from SSD, {again} byte-exact")
        return DemoResult(len(refs), verified, again, recovered)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _verify(store: TieredStore, refs: list[ChunkRef]) -> int:
    good = 0
    for ref in refs:
        with store.get(NAMESPACE, ref.key) as reader:
            expected = _payload(ref.key, reader.nbytes).tobytes()
            good += hashlib.sha256(reader.to_bytes()).digest() == hashlib.sha256(expected).digest()
    return good


def _print_tiers(store: TieredStore, out: Callable[[str], None]) -> None:
    stats = store.stats()
    header = (
        f"{'tier':8} {'kind':6} {'capacity':>10} {'used':>10} {'objects':>7} "
        f"{'hit tok':>8} {'demoted':>7} {'promoted':>8} {'evicted':>7}"
    )
    out(header)
    out("-" * len(header))
    for t in stats.tiers:
        out(
            f"{t.name:8} {t.kind:6} {format_size(t.capacity_bytes):>10} "
            f"{format_size(t.used_bytes):>10} "
            f"{t.objects:>7} {t.hit_tokens:>8} {t.demotions:>7} {t.promotions:>8} "
            f"{t.evictions:>7}"
        )
