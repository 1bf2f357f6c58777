"""Prefill -> decode streaming: how much of a prompt's KV the decode node holds when prefill ends.

Real parts only: a vLLM CPU engine (the runner of tests/e2e/vllm, in a subprocess) of a
random-weight Llama built locally (tests/models/build_tiny_llama.py, ``MODEL``: 32 layers,
so layer-wise streaming has something to overlap), with KVFabricConnector as a
``kv_producer`` on node ``prefill-a``; three more node daemons on one real redis-server
(``kvfabric serve``, separate processes, the socket transport on loopback).

Each measured prompt (``PROMPT_TOKENS`` random tokens, one engine step: the whole prompt is
one batch) asks for a push to node ``decode-b`` (``kv_transfer_params: {"kvfabric":
{"push_to": "decode-b"}}``): the producer's connector reserves the step's chunks on its
daemon after the first layer and has it push them, each layer as soon as it is committed.

Measured from outside, on one monotonic clock (this process): two observer threads pin the
prompt's last chunk on ``prefill-a`` and on ``decode-b`` as soon as it exists there and wait
on its layers one by one; each layer's wake-up time is when it was committed by the
producer, resp. readable on the decode node. Every chunk of a step is committed and pushed
layer by layer together, so the last chunk stands for them all.

- ``landed_fraction_at_prefill_end``: the share of layers readable on ``decode-b`` when the
  producer committed the last one (prefill's end), worst prompt (target >= 0.95, the seed's
  bar; at most ``(layers - 1) / layers``: the last layer leaves once computed);
- ``transfer_tail_ms_after_prefill``: from prefill's end to the last layer readable on
  ``decode-b``, median;
- ``send_after_prefill_ms``: the baseline, in the same run: the moment the producer
  committed a prompt's last layer, the same chunks pushed as one transfer to ``decode-c``
  (the ``push`` op's wall, pin and reservation included: what a hand-off that starts after
  prefill costs, under the same load: the engine goes on running), median;
- ``tail_vs_send_after_prefill``: the two medians' ratio (target <= 0.1);
- ``pull_after_prefill_ms``: the pull mode for comparison: ``decode-d`` prefetches the
  chunks from ``prefill-a`` after the engine's job ended (the ``prefetch`` op's wall, on a
  machine no engine loads), median;
- ``layer_lag_ms``: from a layer committed by the producer to readable on ``decode-b``,
  median over the layers before the last (the streaming's per-layer cost under load);
- ``pusher_landed_fraction``: what the producer's daemon itself reports
  (``kvfabric_push_landed_fraction`` of its pushes to ``decode-b``'s hardware class, mean,
  the warm-up's included), a check on the observers;
- ``fp8_wire_bytes_ratio``: after the engine's job, each measured prompt pushed again to
  ``decode-e``, whose hardware class ``prefill-a``'s ``cluster.fp8_wire_peers`` names: the
  bytes the transport moved over what they are in bf16 (target <= 0.51), with
  ``fp8_push_ms`` (that push's wall, median) and ``fp8_error_vs_bound`` (the worst
  element's error on ``decode-e`` against ``prefill-a``'s copy, over the bound
  :func:`kvfabric.convert.fp8.error_bound` documents: above 1 fails the run).

Run (``--quick``: 2 measured prompts, about three minutes on a quiet 2-core machine, most
of it the engine's start; without it 5)::

    python benchmarks/pd_stream_bench.py --quick --json
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import host_cpu, median
from _runner import Benchmark, Outcome, model_dir_option, run_benchmark
from cluster_nodes import cluster_node
from daemon_process import DaemonProcess
from engine_jobs import kvfabric_connector, load_model_builder, run_engine_job
from redis_process import RedisServer
# isort: on

import argparse
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvfabric.client import Client
from kvfabric.errors import NotFoundError
from kvfabric.hashing import chunk_keys
from kvfabric.spec import KVSpec, Namespace

MODEL = {
    "layers": 32,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 1024,
    "vocab": 2048,
}
PROMPT_TOKENS = 4096  # 16 chunks of 256
MODEL_ID = "pd-stream"  # the connector's namespace model id, so this process can name chunks
NS = Namespace(
    MODEL_ID,
    KVSpec(
        num_layers=MODEL["layers"],
        num_kv_heads=MODEL["kv_heads"],
        head_dim=MODEL["head_dim"],
        dtype="bfloat16",
        chunk_tokens=256,
    ),
)
NODES = ("prefill-a", "decode-b", "decode-c", "decode-d", "decode-e")
STREAMED_CLASS = "decode-stream"  # decode-b's hardware class; decode-c's is "baseline"
FP8_CLASS = "decode-fp8"  # decode-e's: prefill-a pushes to it as fp8
# staging on both ends holds a whole push's encoded chunks (half of a prompt's 128 MiB)
WIRE_STAGING = "cluster.wire_staging_bytes=256MiB"
DAEMON_TIERS = ("store.tiers.dram.capacity=1GiB", "store.tiers.ssd.capacity=1GiB")
JOB_TIMEOUT_S = 900.0  # a cold first vLLM import on a loaded 2-core machine
LAYER_WAIT_S = 300.0  # one layer of a prompt the engine has begun: far below a start-up
# A push, its reservations on the target and the observers' pins last a whole prefill, which
# took 79 s on an AMD EPYC host without AVX-512 (bf16 matmuls on torch's reference path):
# the defaults (a 10 s push, 30 s reservations, 60 s pins) cut such pushes short.
STEP_LEASES = (f"store.reservation_timeout_s={LAYER_WAIT_S}", f"store.pin_timeout_s={LAYER_WAIT_S}")
POLL_S = 0.002  # how often an observer looks for a chunk not reserved yet

TARGETS: dict[str, tuple[str, float]] = {
    "landed_fraction_at_prefill_end": (">=", 0.95),
    "tail_vs_send_after_prefill": ("<=", 0.1),
    "fp8_wire_bytes_ratio": ("<=", 0.51),
    "fp8_error_vs_bound": ("<=", 1.0),
}

FIGURES: list[tuple[str, str]] = [
    ("landed_fraction_at_prefill_end", "layers on the decode node at prefill's end, worst prompt"),
    ("transfer_tail_ms_after_prefill", "prefill's end -> last layer on the decode node, ms"),
    ("send_after_prefill_ms", "baseline: the chunks pushed once the prompt is done, ms"),
    ("tail_vs_send_after_prefill", "streamed tail / send after prefill"),
    ("pull_after_prefill_ms", "pull mode: the decode node prefetches once done, ms"),
    ("layer_lag_ms", "a layer committed by the producer -> on the decode node, median, ms"),
    ("pusher_landed_fraction", "the producer daemon's own figure, mean over its pushes"),
    ("pusher_pushes", "its streamed pushes (one per prompt, the warm-up's included)"),
    ("fp8_wire_bytes_ratio", "a prompt pushed as fp8: bytes moved / its bf16 bytes"),
    ("fp8_push_ms", "that push (to decode-e, after the job), median, ms"),
    ("fp8_error_vs_bound", "worst element's error there / the documented fp8 bound"),
    ("prefill_layers_ms", "first -> last layer committed by the producer, median, ms"),
    ("prompts", "measured prompts (plus one warm-up)"),
    ("layers", "model layers"),
    ("kv_mib_per_prompt", "KV of one prompt, MiB"),
    ("host_cpu", "host CPU (AMX: whether it has it)"),
]


@dataclass(frozen=True)
class Settings:
    prompts: int


QUICK = Settings(prompts=2)
FULL = Settings(prompts=5)


@dataclass
class LayerTimes:
    """When each layer of one chunk became readable on one node (this process's clock)."""

    at: list[float] = field(default_factory=list)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, MODEL["vocab"]) for _ in range(PROMPT_TOKENS)]


def observe(
    socket: str,
    keys: list[bytes],
    out: list[LayerTimes],
    errors: list[str],
    at_end: Callable[[int], None] | None = None,
) -> None:
    """For each key in turn: pin it once it exists on the node, note each layer's arrival;
    ``at_end(i)`` runs (in a thread of its own) as soon as the i-th key is complete."""
    try:
        with Client(socket) as client:
            for i, key in enumerate(keys):
                while True:
                    try:
                        reader = client.get(NS, key)
                        break
                    except NotFoundError:
                        time.sleep(POLL_S)
                times = LayerTimes()
                with reader:
                    for layer in range(NS.spec.num_layers):
                        reader.wait_layer(layer, LAYER_WAIT_S)
                        times.at.append(time.monotonic())
                if at_end is not None:
                    threading.Thread(target=at_end, args=(i,), daemon=True).start()
                out.append(times)
    except Exception as exc:  # reported by the main thread, which owns the outcome
        errors.append(f"observer on {socket}: {exc!r}")


class Baseline:
    """The same chunks sent as one transfer the moment prefill ended (so under the same
    load as the streamed tail: the engine goes on running): a push to ``decode-c``."""

    def __init__(self, socket: str, keys: list[list[bytes]], errors: list[str]) -> None:
        self._socket = socket
        self._keys = keys
        self._errors = errors
        self.seconds: dict[int, float] = {}

    def send(self, i: int) -> None:
        try:
            with Client(self._socket) as client:
                started = time.monotonic()
                result = client.push(NS, self._keys[i], "decode-c", timeout=60.0)
                self.seconds[i] = time.monotonic() - started
            if result["pushed"] != len(self._keys[i]):
                self._errors.append(f"prompt {i}: the baseline push moved {result}")
        except Exception as exc:
            self._errors.append(f"baseline push of prompt {i}: {exc!r}")


def histogram(url: str, name: str, target_class: str) -> tuple[float, float]:
    """A push histogram's (sum, count) for one target class."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.labels.get("target_class") != target_class:
                    continue
                if sample.name == name + "_sum":
                    total += sample.value
                elif sample.name == name + "_count":
                    count += sample.value
    return total, count


def streamed_pushes(url: str) -> tuple[float, int]:
    """The producer daemon's own landed fraction (mean) over its pushes to ``decode-b``
    (the baselines go to another hardware class), and how many there were."""
    total, count = histogram(url, "kvfabric_push_landed_fraction", STREAMED_CLASS)
    return (total / count if count else float("nan")), int(count)


def run_producer(root: Path, model: Path, socket: str, prompts: list[list[int]]) -> None:
    job = {
        "model": str(model),
        "scratch_dir": str(root / "job" / "scratch"),
        "engines": [
            {
                "name": "prefill",
                "kv_transfer_config": kvfabric_connector(
                    socket, "kv_producer", model_id=MODEL_ID, save_timeout_s=LAYER_WAIT_S
                ),
                "prompts": prompts,
                "max_tokens": 1,
                "max_model_len": PROMPT_TOKENS + 256,
                "max_num_batched_tokens": PROMPT_TOKENS,  # one step: one push per prompt
                "kv_transfer_params": [{"kvfabric": {"push_to": "decode-b"}}] * len(prompts),
            }
        ],
    }
    run = run_engine_job(root / "job", job, stall_s=JOB_TIMEOUT_S, deadline_s=JOB_TIMEOUT_S)
    failure = run.failure()
    if failure is not None:
        raise RuntimeError(failure)


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    settings = QUICK if args.quick else FULL
    model = load_model_builder().build_tiny_llama(args.model_dir or root / "model", **MODEL)
    redis = RedisServer(root).start()
    daemons: dict[str, DaemonProcess] = {}
    try:
        for name in NODES:
            kind = {"decode-b": STREAMED_CLASS, "decode-c": "baseline", "decode-e": FP8_CLASS}
            settings_of = cluster_node(
                redis.url,
                name,
                f"cluster.hardware_class={kind.get(name, 'generic')}",
                f"cluster.fp8_wire_peers={FP8_CLASS}",
                WIRE_STAGING,
                *STEP_LEASES,
                transport="socket",
                tiers=DAEMON_TIERS,
                lease_ttl_s=None,
            )
            daemons[name] = DaemonProcess(root / name, settings_of).start()
        return measure(settings, root, model, daemons)
    finally:
        for daemon in daemons.values():
            daemon.kill()
        redis.kill()


def measure(
    settings: Settings, root: Path, model: Path, daemons: dict[str, DaemonProcess]
) -> Outcome:
    prompts = [prompt(seed) for seed in range(settings.prompts + 1)]  # [0]: the warm-up
    keys = [chunk_keys(NS, p, include_partial=False) for p in prompts]
    last_keys = [k[-1] for k in keys]
    produced: list[LayerTimes] = []
    landed: list[LayerTimes] = []
    errors: list[str] = []
    baseline = Baseline(daemons["prefill-a"].socket, keys, errors)
    observers = [
        threading.Thread(
            target=observe,
            args=(daemons["prefill-a"].socket, last_keys, produced, errors, baseline.send),
            daemon=True,
        ),
        threading.Thread(
            target=observe,
            args=(daemons["decode-b"].socket, last_keys, landed, errors),
            daemon=True,
        ),
    ]
    for thread in observers:
        thread.start()
    run_producer(root, model, daemons["prefill-a"].socket, prompts)
    for thread in observers:
        thread.join(LAYER_WAIT_S)
    deadline = time.monotonic() + 120.0
    while len(baseline.seconds) < len(prompts) and not errors and time.monotonic() < deadline:
        time.sleep(0.1)
    if errors or len(produced) != len(prompts) or len(landed) != len(prompts):
        raise RuntimeError(f"the observers saw {len(produced)}/{len(landed)} prompts: {errors}")

    fractions, tails, lags, spans, pulls = [], [], [], [], []
    with (
        Client(daemons["decode-d"].socket) as puller,
        Client(daemons["decode-b"].socket) as decode,
    ):
        for i in range(1, len(prompts)):  # the warm-up is not measured
            if not all(decode.contains(NS, keys[i])):
                raise RuntimeError(f"prompt {i}: decode-b does not hold every chunk")
            end = produced[i].at[-1]
            fractions.append(sum(t <= end for t in landed[i].at) / NS.spec.num_layers)
            tails.append(landed[i].at[-1] - end)
            lags += [d - p for p, d in zip(produced[i].at[:-1], landed[i].at[:-1])]
            spans.append(end - produced[i].at[0])
            started = time.monotonic()
            result = puller.prefetch(NS, keys=keys[i], timeout=60.0)
            pulls.append(time.monotonic() - started)
            if result["pulled"] != len(keys[i]):
                raise RuntimeError(f"prompt {i}: the pull moved {result}")
    fp8 = fp8_pushes(daemons["prefill-a"].socket, daemons["decode-e"].socket, keys)
    sends = [baseline.seconds[i] for i in range(1, len(prompts))]
    pusher = streamed_pushes(daemons["prefill-a"].http_url)
    kv_bytes = NS.spec.chunk_bytes * len(keys[0])
    figures = {
        "landed_fraction_at_prefill_end": round(min(fractions), 4),
        "transfer_tail_ms_after_prefill": round(median(tails) * 1000, 2),
        "send_after_prefill_ms": round(median(sends) * 1000, 2),
        "tail_vs_send_after_prefill": round(median(tails) / median(sends), 4),
        "pull_after_prefill_ms": round(median(pulls) * 1000, 2),
        "layer_lag_ms": round(median(lags) * 1000, 2),
        "pusher_landed_fraction": round(pusher[0], 4),
        "pusher_pushes": pusher[1],
        **fp8,
        "prefill_layers_ms": round(median(spans) * 1000, 1),
        "prompts": settings.prompts,
        "layers": NS.spec.num_layers,
        "kv_mib_per_prompt": round(kv_bytes / 2**20, 1),
        "host_cpu": host_cpu(),
        "landed_fraction_per_prompt": [round(f, 4) for f in fractions],
    }
    return Outcome(figures)


def fp8_pushes(source: str, target: str, prompts: list[list[bytes]]) -> dict[str, float]:
    """Each prompt's chunks pushed from ``source`` to ``target`` as fp8 (the source's
    configuration names the target's class); the bytes moved, the wall, and the worst
    element's error on the target against the documented bound. The first prompt is the
    warm-up: a daemon's first fp8 transfer loads torch (about a second)."""
    import torch

    from kvfabric.convert import fp8, read_layer

    ratios, walls, worst = [], [], 0.0
    with Client(source) as producer, Client(target) as consumer:
        producer.push(NS, prompts[0], "decode-e", timeout=60.0)
        for keys in prompts[1:]:
            started = time.monotonic()
            result = producer.push(NS, keys, "decode-e", timeout=60.0)
            walls.append(time.monotonic() - started)
            if result["pushed"] != len(keys):
                raise RuntimeError(f"the fp8 push moved {result}")
            ratios.append(result["wire_bytes"] / result["native_bytes"])
            for key in (keys[0], keys[-1]):
                with producer.get(NS, key) as sent, consumer.get(NS, key) as landed:
                    for layer in range(NS.spec.num_layers):
                        x = read_layer(sent, layer)
                        bound = fp8.error_bound(x, fp8.compute_scales(x), torch.bfloat16)
                        error = (read_layer(landed, layer).float() - x.float()).abs()
                        worst = max(worst, float((error / bound.clamp_min(1e-30)).max()))
    return {
        "fp8_wire_bytes_ratio": round(max(ratios), 4),
        "fp8_push_ms": round(median(walls) * 1000, 2),
        "fp8_error_vs_bound": round(worst, 4),
    }


BENCH = Benchmark(
    __doc__,
    "kvfabric-pd-stream-",
    TARGETS,
    FIGURES,
    quick_help=f"{QUICK.prompts} measured prompts instead of {FULL.prompts}",
    add_arguments=model_dir_option,
    keep_option=True,
)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
