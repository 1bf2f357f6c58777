"""Store benchmark: the tiered store's hot paths against the plain operation they wrap.

Every figure comes from one run of this script:

* ``dram_put_vs_memcpy`` / ``dram_get_vs_memcpy`` -- ``store.put`` and ``store.get`` +
  ``read_into`` of 4 MiB objects in a pre-faulted 64-object DRAM tier, divided by
  ``numpy.copyto`` of the same 4 MiB into / out of the same number of 4 MiB slots. The
  baseline rotates over as many slots as the store holds objects: copying into one buffer
  again and again stays in the CPU cache (``memcpy_cache_hot_gb_s`` shows how much faster
  that is), and the store never gets that luxury.
* ``lookup_512_us_p50`` -- ``store.lookup`` of a fully stored 512-chunk chain (a 128k-token
  prompt at 256 tokens per chunk), in process.
* ``hash_speedup_vs_sha256_pickle`` -- tokens/s of ``chunk_keys`` on an int32 array over a
  vLLM-style chain (sha256 of the pickled ``(parent, 16-token block, None)``) on the same
  128k-token prompt; ``..._from_list`` hands kvfabric the Python list the baseline gets.
  ``hash_mtokens_s_from_list``: that list's tokens/s (what an engine hands over; target
  >= 70, LMCache's figure from a list; the compiled ``kvfabric._tokens`` converts it).
* ``ssd_write_vs_raw`` / ``ssd_read_vs_raw`` -- ``DiskTier.write(...).result()`` and
  ``read_into`` of 4 MiB records against ``os.pwrite`` / ``os.preadv`` of as many 4 MiB
  blocks to a file in the same directory. Both sides go through the page cache (no
  O_DIRECT) and read back what they just wrote. ``store_demote_ssd_mb_s`` is the end-to-end
  rate at which puts into a full DRAM tier push objects down to SSD (informational).
* ``metadata_bytes_per_object`` -- Python memory (tracemalloc) the store keeps per small
  object, keys included, over 20k puts into a DRAM-only store with a preallocated arena.

Baseline and store are measured in interleaved rounds (which side goes first alternates),
each side's median per round, the ratio's median over rounds; a first round warms both up
and is discarded. Numeric libraries run single-threaded.

Run (``--quick``: under a minute; without it: a few minutes)::

    python benchmarks/store_bench.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr). ``--dir``
picks where the scratch directory is created (put it on the SSD you want to measure).
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import (
    Timer,
    host_cpu,
    measure,
    measure_pairs,
    median,
    memfd_pages,
    percentile,
    tokens,
    touched,
)
from _runner import Benchmark, Outcome, run_benchmark
# isort: on

import argparse
import gc
import hashlib
import os
import pickle  # noqa: TID251 (the baseline measured is vLLM's pickle-based hash; no wire)
import shutil
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvfabric.hashing import ROOT, chunk_hashes, chunk_keys
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.disk import DiskExtent, DiskTier

MiB = 1 << 20
PAGE = 256 * 1024  # the DRAM tier's default page size
OBJECT_BYTES = 4 * MiB
# Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16): 32 tokens make 4 MiB.
BIG = Namespace("bench-4mib", KVSpec(32, 8, 128, "bfloat16", chunk_tokens=32))
# 4 KiB chunks of 256 tokens: index-bound figures (lookup, hashing, metadata).
SMALL = Namespace("bench-small", KVSpec(1, 1, 4, "float16", chunk_tokens=256))
SMALL_PAGE = 4096
PROMPT_TOKENS = 128 * 1024  # 512 chunks of 256 tokens
DRAM_OBJECTS = 64  # 256 MiB: the whole put phase fits, nothing is evicted
RESIDENT_OBJECTS = 16  # DRAM tier size in the demotion run
META_CHAIN = 32  # chunks per prompt in the metadata run (8k-token prompts)
SSD_META = bytes(160)  # about the size of the store's msgpack record metadata

TARGETS: dict[str, tuple[str, float]] = {
    "dram_put_vs_memcpy": (">=", 0.8),
    "dram_get_vs_memcpy": (">=", 0.9),
    "lookup_512_us_p50": ("<=", 50),
    "hash_speedup_vs_sha256_pickle": (">=", 20),
    "hash_mtokens_s_from_list": (">=", 70),
    "ssd_write_vs_raw": (">=", 0.7),
    "ssd_read_vs_raw": (">=", 0.7),
    "metadata_bytes_per_object": ("<=", 512),
}

FIGURES: list[tuple[str, str]] = [
    ("dram_put_vs_memcpy", "store.put 4 MiB / np.copyto into as many slots"),
    ("dram_get_vs_memcpy", "get + read_into 4 MiB / np.copyto out of them"),
    ("dram_put_gb_s", "store.put, GB/s"),
    ("dram_get_gb_s", "get + read_into, GB/s"),
    ("memcpy_in_gb_s", "np.copyto into 64 rotating 4 MiB slots, GB/s"),
    ("memcpy_out_gb_s", "np.copyto out of 64 rotating 4 MiB slots, GB/s"),
    ("memcpy_cache_hot_gb_s", "np.copyto between two fixed 4 MiB buffers, GB/s"),
    ("lookup_512_us_p50", "store.lookup, 512-chunk chain, all stored"),
    ("lookup_512_us_p99", "same, p99"),
    ("hash_speedup_vs_sha256_pickle", "chunk_keys(int32 array) / sha256(pickle) chain"),
    ("hash_speedup_vs_sha256_pickle_from_list", "chunk_keys(list) / sha256(pickle) chain"),
    ("hash_mtokens_s", "chunk_keys(int32 array), Mtokens/s"),
    ("hash_mtokens_s_from_list", "chunk_keys(Python list), Mtokens/s"),
    ("sha256_pickle_mtokens_s", "sha256(pickle) chain, Mtokens/s"),
    ("ssd_write_vs_raw", "DiskTier.write 4 MiB / os.pwrite"),
    ("ssd_read_vs_raw", "DiskTier.read_into 4 MiB / os.preadv"),
    ("ssd_read_vs_raw_checksummed", "DiskTier.read_into / os.preadv + xxh3_64 of the bytes"),
    ("ssd_write_gb_s", "DiskTier.write(...).result(), GB/s"),
    ("ssd_read_gb_s", "DiskTier.read_into, GB/s"),
    ("raw_write_gb_s", "os.pwrite, GB/s"),
    ("raw_read_gb_s", "os.preadv, GB/s"),
    ("store_demote_ssd_mb_s", "puts into full DRAM pushing objects to SSD, MB/s"),
    ("metadata_bytes_per_object", "tracemalloc bytes held per stored object"),
    ("host_cpu", "host CPU (AMX: whether it has it)"),
    ("memfd_pages", "pages of the arenas (kernel shmem THP setting, huge pages free)"),
]


@dataclass(frozen=True)
class Settings:
    rounds: int  # measured rounds per comparison (plus one discarded warm-up round)
    lookups: int  # lookup calls sampled
    hash_calls: int  # calls per side and round
    ssd_records: int  # 4 MiB records (and raw blocks) per SSD round
    demote_objects: int  # objects pushed to SSD per demotion run
    metadata_objects: int


QUICK = Settings(
    rounds=7,
    lookups=5_000,
    hash_calls=5,
    ssd_records=48,
    demote_objects=64,
    metadata_objects=20_000,
)
FULL = Settings(
    rounds=21,
    lookups=50_000,
    hash_calls=10,
    ssd_records=64,
    demote_objects=128,
    metadata_objects=20_000,
)


def page_views(buf: np.ndarray) -> list[np.ndarray]:
    """Page-sized views: the pieces the store hands the SSD tier (and reads back into)."""
    return [buf[i : i + PAGE] for i in range(0, buf.nbytes, PAGE)]


def open_store(data_dir: Path, *tiers: TierConfig) -> TieredStore:
    # No maintenance thread: every demotion is caused by the measured puts themselves.
    return TieredStore(StoreConfig(data_dir=str(data_dir), tiers=tiers), maintenance=False)


def gb_s(seconds: float) -> float:
    """Throughput of one 4 MiB object moved in ``seconds``."""
    return OBJECT_BYTES / seconds / 1e9


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: median([r[name] for r in rounds]) for name in rounds[0]}


def bench_dram(root: Path, cfg: Settings) -> dict[str, float]:
    n = DRAM_OBJECTS
    src = np.random.default_rng(1).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    dst = touched(OBJECT_BYTES)
    slots = touched(n * OBJECT_BYTES).reshape(n, OBJECT_BYTES)
    refs = chunk_hashes(BIG, tokens(n * BIG.spec.chunk_tokens, seed=1))
    tier = TierConfig(TierKind.DRAM, n * OBJECT_BYTES, prefault=True)
    with open_store(root / "dram", tier) as store:

        def put(i: int) -> None:
            if not store.put(BIG, refs[i].key, src, parent=refs[i].parent):
                raise RuntimeError("key already stored: the put was not measured")

        def get(i: int) -> None:
            with store.get(BIG, refs[i].key) as reader:
                reader.read_into(dst)

        rounds = []
        for r in range(cfg.rounds + 1):
            (copy_in, put_s), (copy_out, get_s) = measure_pairs(
                [
                    (lambda i: np.copyto(slots[i], src), put),
                    (lambda i: np.copyto(dst, slots[i]), get),
                ],
                n,
                flip=r % 2 == 1,
            )
            hot = median(measure(lambda i: np.copyto(dst, src), n))
            for ref in refs:  # the next round puts into the same (already faulted) pages
                store.delete(BIG, ref.key)
            rounds.append(
                {
                    "dram_put_vs_memcpy": copy_in / put_s,
                    "dram_get_vs_memcpy": copy_out / get_s,
                    "dram_put_gb_s": gb_s(put_s),
                    "dram_get_gb_s": gb_s(get_s),
                    "memcpy_in_gb_s": gb_s(copy_in),
                    "memcpy_out_gb_s": gb_s(copy_out),
                    "memcpy_cache_hot_gb_s": gb_s(hot),
                }
            )
        dram = store.stats().tiers[0]
        if dram.evictions or dram.demotions:
            raise RuntimeError("the DRAM tier evicted objects: the put phase did not fit")
    return medians(rounds[1:])


def bench_lookup(root: Path, cfg: Settings) -> dict[str, float]:
    refs = chunk_hashes(SMALL, tokens(PROMPT_TOKENS, seed=2))
    keys = [ref.key for ref in refs]
    payload = np.zeros(SMALL.spec.chunk_bytes, dtype=np.uint8)
    tier = TierConfig(TierKind.DRAM, len(refs) * SMALL_PAGE, page_size=SMALL_PAGE)
    with open_store(root / "lookup", tier) as store:
        for ref in refs:
            store.put(SMALL, ref.key, payload, parent=ref.parent)
        if store.lookup(SMALL, keys).matched_chunks != len(keys):
            raise RuntimeError("the chain is not fully stored")
        measure(lambda _: store.lookup(SMALL, keys), cfg.lookups // 10)  # warm-up
        samples = measure(lambda _: store.lookup(SMALL, keys), cfg.lookups)
    return {
        "lookup_512_us_p50": percentile(samples, 50) * 1e6,
        "lookup_512_us_p99": percentile(samples, 99) * 1e6,
    }


def sha256_pickle_chain(token_list: list[int], block: int = 16) -> list[bytes]:
    """vLLM-style prefix-cache keys: sha256 of the pickled (parent, block tokens, extra keys)."""
    parent = bytes(32)
    out = []
    for i in range(0, len(token_list), block):
        block_tokens = tuple(token_list[i : i + block])
        parent = hashlib.sha256(pickle.dumps((parent, block_tokens, None))).digest()
        out.append(parent)
    return out


def bench_hash(cfg: Settings) -> dict[str, float]:
    prompt = tokens(PROMPT_TOKENS, seed=3)
    as_list = prompt.tolist()
    if chunk_keys(SMALL, as_list) != chunk_keys(SMALL, prompt):
        raise RuntimeError("chunk_keys differs between a list and an int32 array")

    def baseline(_: int) -> None:
        sha256_pickle_chain(as_list)

    rounds = []
    for r in range(cfg.rounds + 1):
        (base_a, array_s), (base_l, list_s) = measure_pairs(
            [
                (baseline, lambda _: chunk_keys(SMALL, prompt)),
                (baseline, lambda _: chunk_keys(SMALL, as_list)),
            ],
            cfg.hash_calls,
            flip=r % 2 == 1,
        )
        rounds.append(
            {
                "hash_speedup_vs_sha256_pickle": base_a / array_s,
                "hash_speedup_vs_sha256_pickle_from_list": base_l / list_s,
                "hash_mtokens_s": PROMPT_TOKENS / array_s / 1e6,
                "hash_mtokens_s_from_list": PROMPT_TOKENS / list_s / 1e6,
                "sha256_pickle_mtokens_s": PROMPT_TOKENS / base_a / 1e6,
            }
        )
    return medians(rounds[1:])


def ssd_round(work: Path, n: int, src: np.ndarray, dst: np.ndarray, flip: bool) -> dict[str, float]:
    """``n`` 4 MiB records through a fresh DiskTier vs ``n`` raw blocks in its directory."""
    tier = DiskTier(work, capacity_bytes=2 * n * OBJECT_BYTES)
    tier.scan()
    fd = os.open(work / "raw.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    src_pages, dst_pages = page_views(src), page_views(dst)
    extents: list[DiskExtent] = []

    def raw_write(i: int) -> None:
        if os.pwrite(fd, src, i * OBJECT_BYTES) != OBJECT_BYTES:
            raise OSError("short write")

    def raw_read(i: int) -> None:
        if os.preadv(fd, [dst], i * OBJECT_BYTES) != OBJECT_BYTES:
            raise OSError("short read")

    def raw_read_checked(i: int) -> None:
        # what any reader that refuses corrupt data pays: the read plus one xxh3 pass
        raw_read(i)
        xxhash.xxh3_64_intdigest(dst)

    def tier_write(i: int) -> None:
        extents.append(tier.write(i.to_bytes(16, "little"), SSD_META, src_pages).result())

    try:
        (raw_w, tier_w), (raw_r, tier_r), (raw_rc, tier_rc) = measure_pairs(
            [
                (raw_write, tier_write),
                (raw_read, lambda i: tier.read_into(extents[i], dst_pages)),
                (raw_read_checked, lambda i: tier.read_into(extents[i], dst_pages)),
            ],
            n,
            flip=flip,
        )
    finally:
        os.close(fd)
        tier.close()
    return {
        "ssd_write_vs_raw": raw_w / tier_w,
        "ssd_read_vs_raw": raw_r / tier_r,
        "ssd_read_vs_raw_checksummed": raw_rc / tier_rc,
        "ssd_write_gb_s": gb_s(tier_w),
        "ssd_read_gb_s": gb_s(tier_r),
        "raw_write_gb_s": gb_s(raw_w),
        "raw_read_gb_s": gb_s(raw_r),
    }


def bench_ssd(root: Path, cfg: Settings) -> dict[str, float]:
    src = np.random.default_rng(4).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    dst = touched(OBJECT_BYTES)
    rounds = []
    for r in range(cfg.rounds + 1):
        # A fresh directory per round: both sides allocate new file blocks every time.
        work = root / f"ssd-{r}"
        try:
            rounds.append(ssd_round(work, cfg.ssd_records, src, dst, flip=r % 2 == 1))
        finally:
            shutil.rmtree(work)
    return medians(rounds[1:])


def bench_demote(root: Path, cfg: Settings) -> dict[str, float]:
    """Puts into a full DRAM tier: each has to wait for older objects to reach the SSD."""
    src = np.random.default_rng(5).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    total = RESIDENT_OBJECTS + cfg.demote_objects
    rates = []
    for r in range(cfg.rounds):
        refs = chunk_hashes(BIG, tokens(total * BIG.spec.chunk_tokens, seed=100 + r))
        tiers = (
            TierConfig(TierKind.DRAM, RESIDENT_OBJECTS * OBJECT_BYTES, prefault=True),
            TierConfig(TierKind.SSD, 2 * total * OBJECT_BYTES),
        )
        with open_store(root / f"demote-{r}", *tiers) as store:
            for ref in refs[:RESIDENT_OBJECTS]:  # fill DRAM; from here on every put pushes
                store.put(BIG, ref.key, src, parent=ref.parent)
            with Timer() as timer:
                for ref in refs[RESIDENT_OBJECTS:]:
                    store.put(BIG, ref.key, src, parent=ref.parent)
                store.flush()
        # Read after close: a demotion is counted by a callback that may outlive flush().
        rates.append(store.stats().tiers[-1].bytes_in / timer.seconds / 1e6)
        shutil.rmtree(root / f"demote-{r}")
    return {"store_demote_ssd_mb_s": median(rates)}


def bench_metadata(root: Path, cfg: Settings) -> dict[str, float]:
    n = cfg.metadata_objects
    prompts = tokens(n * SMALL.spec.chunk_tokens, seed=6)
    payload = np.zeros(SMALL.spec.chunk_bytes, dtype=np.uint8)
    step = META_CHAIN * SMALL.spec.chunk_tokens
    # An arena of exactly n pages: its page allocator is built (and sized) before the window.
    # Plain pages: on reserved huge pages the arena would round down to whole 2 MiB pages.
    tier = TierConfig(TierKind.DRAM, n * SMALL_PAGE, page_size=SMALL_PAGE, huge_pages="off")
    with open_store(root / "metadata", tier) as store:
        gc.collect()
        tracemalloc.start()  # only what is allocated from here on is counted, keys included
        try:
            for start in range(0, n * SMALL.spec.chunk_tokens, step):
                parent = ROOT
                for key in chunk_keys(SMALL, prompts[start : start + step]):
                    store.put(SMALL, key, payload, parent=parent)
                    parent = key
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        if len(store) != n:
            raise RuntimeError(f"stored {len(store)} objects, expected {n}")
    return {"metadata_bytes_per_object": held / n}


BENCH = Benchmark(__doc__, "kvfabric-store-bench-", TARGETS, FIGURES, scratch_dir_option=True)


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    return Outcome(
        {
            **bench_dram(root, cfg),
            **bench_lookup(root, cfg),
            **bench_hash(cfg),
            **bench_ssd(root, cfg),
            **bench_demote(root, cfg),
            **bench_metadata(root, cfg),
            "host_cpu": host_cpu(),
            "memfd_pages": memfd_pages(DRAM_OBJECTS * OBJECT_BYTES),
        }
    )


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
