"""Conversion benchmark: what a heterogeneous consumer pays to read KV in its own shape.

Every figure comes from one run of this script:

* ``tp_slice_read_vs_memcpy`` -- one tensor-parallel rank's share (KV heads ``[0, H/4)`` of
  every layer: 8 MiB of a 32 MiB Llama-3-8B-shaped chunk of 256 tokens, 64 runs of 128 KiB)
  read out of a real in-process TieredStore (one DRAM tier: a pre-faulted memfd arena of
  256 KiB pages) into a preallocated tensor, lookup, pin, page views and release included
  (``kvfabric.convert.read_payload(reader, heads=...)``), against one ``numpy.copyto`` of as
  many bytes between two pre-faulted anonymous numpy buffers (which the kernel may back with
  transparent huge pages; shared memory gets none where ``shmem_enabled`` is ``never``).
  Both rotate over four objects / source buffers so neither reads from a hot cache.
  ``tp_slice_read_vs_arena_memcpy`` compares the same read with one ``numpy.copyto`` of as
  many bytes out of the same stored object's arena pages (its first 8 MiB, contiguous; the
  objects stay pinned): the same memory, without the slicing and the store's per-read work.
  ``tp_slice_read_per_layer_vs_memcpy`` is the read done layer by layer
  (``reader.layer_pieces(layer, heads=...)`` copied with ``copy_pieces``), informational.
* ``layout_convert_vs_memcpy`` -- vLLM's CPU block layout (``CpuBlockLayout.transposed_k``,
  the "vec" ISA layout: K transposed inside each block) to canonical and back: ``gather`` then
  ``scatter`` of a 256-token chunk (8 KV heads, head_dim 128, bf16, 128-token blocks, blocks
  out of order in a 64-block cache), argument checks included, against two ``Tensor.copy_``
  of the same 1 MiB between two contiguous tensors. The layout copies through the compiled
  strided-copy routine (``kvfabric.memory.strided``) when the install built it:
  ``compiled_copy_kernel`` is 1 then, 0 when every copy took the torch fallback.
* ``fp8_quantize_gbps`` / ``fp8_dequantize_gbps`` -- input GB/s of ``fp8.quantize`` (bf16 in)
  and ``fp8.dequantize`` (e4m3 in, bf16 out) on one such layer; ``memcpy_gbps`` is the
  baseline copy rate of the same run, for scale.
* ``fp8_bytes_ratio`` -- fp8 bytes (scales included) / bf16 bytes of that chunk: 0.5 plus the
  scales, ``2 / (tokens * head_dim)``, by construction.
* ``fp8_max_abs_error`` / ``fp8_max_rel_error`` -- over the real K and V a tiny random-weight
  Llama (``tests/models/build_tiny_llama.py``, 4 layers, 2 KV heads, head_dim 64) computes in
  bf16 for a few hundred random tokens (transformers, ``use_cache=True``), quantized and
  dequantized to float32. The relative error is taken over the elements in e4m3's normal range
  (``|x| >= scale * 2**-6``), where the bound caps it at ``2**-4``; below it the error is
  absolute (``<= scale * 2**-10``). ``fp8_error_vs_bound`` is the largest error divided by
  the stated per-element bound (must stay <= 1).

Baseline and subject are measured in interleaved rounds (which side goes first alternates),
each side's median per round, the ratio's median over rounds; a first round warms both up and
is discarded. torch and the numeric libraries run single-threaded.

Run (``--quick``: well under a minute once the tiny model is built)::

    python benchmarks/convert_bench.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr).
``--model-dir`` is where the tiny model is built once and reused (default: under the system
temp directory).
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import measure, measure_pairs, median, tokens, touched
from _runner import Benchmark, Outcome, run_benchmark
# isort: on

import argparse
import importlib.util
import os
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from kvfabric.convert import fp8
from kvfabric.convert.dtype import coalesce, read_payload
from kvfabric.hashing import chunk_hashes
from kvfabric.memory import native
from kvfabric.memory.copy import copy_pieces
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# Llama-3-8B-shaped KV: 32 layers, 8 KV heads, head_dim 128, bf16, 256-token chunks (32 MiB).
NS = Namespace("bench-convert", KVSpec(32, 8, 128, "bfloat16", chunk_tokens=256))
SPEC = NS.spec
TP = 4  # the reader is one of 4 ranks: KV heads [0, 2)
OBJECTS = 4
BLOCK = 128  # vLLM CPU block size
CACHE_BLOCKS = 64

TARGETS: dict[str, tuple[str, float]] = {
    "tp_slice_read_vs_memcpy": (">=", 0.8),
    "layout_convert_vs_memcpy": (">=", 0.5),
    # 0.5 exactly is out of reach with the scales counted: 0.5 + 2 / (256 * 128) here.
    "fp8_bytes_ratio": ("<=", 0.501),
    "fp8_max_rel_error": ("<=", 2.0**-4),
    "fp8_error_vs_bound": ("<=", 1.0),
}

FIGURES: list[tuple[str, str]] = [
    ("tp_slice_read_vs_memcpy", "read_payload(heads=1/4) of a stored 32 MiB chunk / np.copyto"),
    ("tp_slice_read_vs_arena_memcpy", "the same read / np.copyto out of the object's pages"),
    ("tp_slice_read_per_layer_vs_memcpy", "the same, layer_pieces + copy_pieces per layer"),
    ("tp_slice_read_gbps", "TP share read, GB/s"),
    ("layout_convert_vs_memcpy", "vLLM CPU block gather + scatter (1 MiB) / 2 copy_"),
    ("layout_gather_vs_memcpy", "gather alone / copy_"),
    ("layout_scatter_vs_memcpy", "scatter alone / copy_"),
    ("compiled_copy_kernel", "1: the compiled strided-copy routine was built and used"),
    ("fp8_quantize_gbps", "fp8.quantize, bf16 input GB/s"),
    ("fp8_dequantize_gbps", "fp8.dequantize to bf16, e4m3 input GB/s"),
    ("memcpy_gbps", "np.copyto of the TP share, GB/s (baseline)"),
    ("arena_memcpy_gbps", "np.copyto of as many bytes out of the arena, GB/s"),
    ("fp8_bytes_ratio", "fp8 + scales bytes / bf16 bytes of a chunk"),
    ("fp8_bytes_saved_per_chunk", "bf16 - fp8 bytes of a 32 MiB chunk"),
    ("fp8_max_abs_error", "tiny-Llama K/V: max |x - dequant(quant(x))|"),
    ("fp8_max_rel_error", "... / |x| over e4m3's normal range"),
    ("fp8_error_vs_bound", "max error / (|x| 2^-4 + scale 2^-10)"),
    ("fp8_kv_amax", "tiny-Llama K/V: max |x| (scale of the errors)"),
]


@dataclass(frozen=True)
class Settings:
    rounds: int  # measured rounds per comparison (plus one discarded warm-up round)
    repeat: int  # calls per side and round
    model_tokens: int  # prompt length run through the tiny model


QUICK = Settings(rounds=5, repeat=8, model_tokens=256)
FULL = Settings(rounds=15, repeat=16, model_tokens=512)


def ratios(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: median([r[name] for r in rounds]) for name in rounds[0]}


def bench_tp_slice(root: Path, cfg: Settings) -> dict[str, float]:
    heads = (0, SPEC.num_kv_heads // TP)
    share = SPEC.chunk_bytes // TP
    refs = chunk_hashes(NS, tokens(OBJECTS * SPEC.chunk_tokens, seed=1))
    sources = [touched(share) for _ in range(OBJECTS)]
    for i, buf in enumerate(sources):
        buf.fill(i + 1)
    dst = torch.empty(
        SPEC.num_layers,
        2,
        heads[1] - heads[0],
        SPEC.chunk_tokens,
        SPEC.head_dim,
        dtype=torch.bfloat16,
    )
    dst_bytes = dst.view(-1).view(torch.uint8).numpy()
    dst_bytes.fill(0)
    payload = np.random.default_rng(2).integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8)
    tier = TierConfig(TierKind.DRAM, OBJECTS * SPEC.chunk_bytes, prefault=True)
    config = StoreConfig(data_dir=str(root / "tp"), tiers=(tier,))
    with TieredStore(config, maintenance=False) as store, ExitStack() as pins:
        for ref in refs:
            store.put(NS, ref.key, payload, parent=ref.parent)
        arena_sources = []  # each object's first `share` bytes, one view of its arena pages
        for ref in refs:
            pages = coalesce(pins.enter_context(store.get(NS, ref.key)).pieces())
            if len(pages) != 1:
                raise RuntimeError("a stored object's pages are not adjacent in the arena")
            arena_sources.append(pages[0][:share])

        def memcpy(i: int) -> None:
            np.copyto(dst_bytes, sources[i % OBJECTS])

        def arena_memcpy(i: int) -> None:
            np.copyto(dst_bytes, arena_sources[i % OBJECTS])

        def whole(i: int) -> None:
            with store.get(NS, refs[i % OBJECTS].key) as reader:
                read_payload(reader, heads=heads, out=dst)

        def per_layer(i: int) -> None:
            with store.get(NS, refs[i % OBJECTS].key) as reader:
                for layer in range(SPEC.num_layers):
                    copy_pieces(
                        [
                            dst_bytes[
                                layer * share // SPEC.num_layers : (layer + 1)
                                * share
                                // SPEC.num_layers
                            ]
                        ],
                        reader.layer_pieces(layer, heads=heads),
                    )

        with store.get(NS, refs[0].key) as reader:  # what is measured reads the right bytes
            want = payload.reshape(SPEC.num_layers, 2, SPEC.num_kv_heads, -1)[:, :, : heads[1]]
            read_payload(reader, heads=heads, out=dst)
            if not np.array_equal(dst_bytes, want.reshape(-1)):
                raise RuntimeError("read_payload(heads=...) returned the wrong bytes")
            per_layer(0)
            if not np.array_equal(dst_bytes, want.reshape(-1)):
                raise RuntimeError("the per-layer read returned the wrong bytes")
        rounds = []
        for r in range(cfg.rounds + 1):
            (base_w, whole_s), (base_a, arena_s), (base_l, layer_s) = measure_pairs(
                [(memcpy, whole), (arena_memcpy, whole), (memcpy, per_layer)],
                cfg.repeat,
                flip=r % 2 == 1,
            )
            rounds.append(
                {
                    "tp_slice_read_vs_memcpy": base_w / whole_s,
                    "tp_slice_read_vs_arena_memcpy": base_a / arena_s,
                    "tp_slice_read_per_layer_vs_memcpy": base_l / layer_s,
                    "tp_slice_read_gbps": share / whole_s / 1e9,
                    "memcpy_gbps": share / base_w / 1e9,
                    "arena_memcpy_gbps": share / base_a / 1e9,
                }
            )
    return ratios(rounds[1:])


def load_layout_module() -> ModuleType:
    """kvfabric_connectors/vllm/layout.py by file path: it needs torch only, not vLLM itself."""
    path = ROOT / "kvfabric_connectors" / "vllm" / "layout.py"
    spec = importlib.util.spec_from_file_location("kvfabric_bench_vllm_layout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench_layout(cfg: Settings) -> dict[str, float]:
    layout_module = load_layout_module()
    heads, dim, num_tokens = SPEC.num_kv_heads, SPEC.head_dim, SPEC.chunk_tokens
    layout = layout_module.CpuBlockLayout.transposed_k(heads, BLOCK, dim, torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(CACHE_BLOCKS, heads, BLOCK, 2 * dim, generator=generator).to(torch.bfloat16)
    block_ids = torch.tensor([37, 5], dtype=torch.int64)  # out of order, far apart
    canonical = torch.empty(2, heads, num_tokens, dim, dtype=torch.bfloat16)
    src = torch.randn(2, heads, num_tokens, dim, generator=generator).to(torch.bfloat16)
    copy_dst = torch.empty_like(src)
    layout.gather(cache, block_ids, 0, num_tokens, out=canonical)
    layout.scatter(cache, block_ids, 0, canonical)
    if not torch.equal(layout.gather(cache, block_ids, 0, num_tokens), canonical):
        raise RuntimeError("gather after scatter does not round-trip")

    def memcpy(_: int) -> None:
        copy_dst.copy_(src)

    def gather(_: int) -> None:
        layout.gather(cache, block_ids, 0, num_tokens, out=canonical)

    def scatter(_: int) -> None:
        layout.scatter(cache, block_ids, 0, canonical)

    repeat = cfg.repeat * 4
    rounds = []
    for r in range(cfg.rounds + 1):
        (base_g, gather_s), (base_s, scatter_s) = measure_pairs(
            [(memcpy, gather), (memcpy, scatter)], repeat, flip=r % 2 == 1
        )
        rounds.append(
            {
                "layout_convert_vs_memcpy": (base_g + base_s) / (gather_s + scatter_s),
                "layout_gather_vs_memcpy": base_g / gather_s,
                "layout_scatter_vs_memcpy": base_s / scatter_s,
            }
        )
    return {**ratios(rounds[1:]), "compiled_copy_kernel": float(native.kernel is not None)}


def bench_fp8_speed(cfg: Settings) -> dict[str, float]:
    generator = torch.Generator().manual_seed(4)
    layer = torch.randn(
        2, SPEC.num_kv_heads, SPEC.chunk_tokens, SPEC.head_dim, generator=generator
    ).to(torch.bfloat16)
    quantized = fp8.quantize(layer)
    out = fp8.QuantizedLayer(torch.empty_like(quantized.data), torch.empty_like(quantized.scales))
    back = torch.empty_like(layer)
    repeat = cfg.repeat * 4
    quant_s, dequant_s = [], []
    for _ in range(cfg.rounds + 1):
        quant_s.append(median(measure(lambda _: fp8.quantize(layer, out=out), repeat)))
        dequant_s.append(
            median(
                measure(
                    lambda _: fp8.dequantize(*quantized, dtype=torch.bfloat16, out=back), repeat
                )
            )
        )
    return {
        "fp8_quantize_gbps": layer.numel() * 2 / median(quant_s[1:]) / 1e9,
        "fp8_dequantize_gbps": quantized.data.numel() / median(dequant_s[1:]) / 1e9,
        "fp8_bytes_ratio": fp8.chunk_nbytes(SPEC) / SPEC.chunk_bytes,
        "fp8_bytes_saved_per_chunk": float(fp8.bytes_saved(SPEC)),
    }


def tiny_model_kv(model_dir: Path, num_tokens: int) -> list[torch.Tensor]:
    """Canonical [2, kv_heads, tokens, head_dim] bf16 K/V per layer of the tiny Llama."""
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
    }.items():
        os.environ.setdefault(name, value)
    spec = importlib.util.spec_from_file_location(
        "kvfabric_bench_build_tiny_llama", ROOT / "tests" / "models" / "build_tiny_llama.py"
    )
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    path = builder.build_tiny_llama(model_dir)

    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.from_numpy(tokens(num_tokens, seed=5, vocab=model.config.vocab_size)).long()
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    layers = []
    for index in range(model.config.num_hidden_layers):
        if hasattr(cache, "layers"):
            keys, values = cache.layers[index].keys, cache.layers[index].values
        else:  # older transformers
            keys, values = cache.key_cache[index], cache.value_cache[index]
        layers.append(torch.stack([keys[0], values[0]]).contiguous())
    return layers


def bench_fp8_error(model_dir: Path, cfg: Settings) -> dict[str, float]:
    max_abs = max_rel = vs_bound = amax = 0.0
    for layer in tiny_model_kv(model_dir, cfg.model_tokens):
        if layer.dtype != torch.bfloat16 or not bool(torch.isfinite(layer).all()):
            raise RuntimeError("the tiny model's KV is not finite bf16")
        quantized = fp8.quantize(layer)
        back = fp8.dequantize(*quantized, dtype=torch.float32).double()
        x = layer.double()
        error = (x - back).abs()
        scales = quantized.scales.double()[:, :, None, None]
        normal = x.abs() >= scales * 2.0**-6
        max_abs = max(max_abs, float(error.max()))
        max_rel = max(max_rel, float((error[normal] / x.abs()[normal]).max()))
        vs_bound = max(vs_bound, float((error / fp8.error_bound(layer, quantized.scales)).max()))
        amax = max(amax, float(x.abs().max()))
    return {
        "fp8_max_abs_error": max_abs,
        "fp8_max_rel_error": max_rel,
        "fp8_error_vs_bound": vs_bound,
        "fp8_kv_amax": amax,
    }


def model_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvfabric-bench-tiny-llama",
        help="where the tiny model is built once and reused",
    )


BENCH = Benchmark(
    __doc__,
    "kvfabric-convert-bench-",
    TARGETS,
    FIGURES,
    quick_help="fewer rounds",
    scratch_dir_option=True,
    add_arguments=model_dir_option,
)


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    return Outcome(
        {
            **bench_tp_slice(root, cfg),
            **bench_layout(cfg),
            **bench_fp8_speed(cfg),
            **bench_fp8_error(args.model_dir, cfg),
        }
    )


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
