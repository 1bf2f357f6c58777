"""vLLM TTFT benchmark: a fabric hit (DRAM and SSD) against recompute and vLLM's prefix cache.

Real vLLM (CPU) engines on a random-weight Llama built locally (tests/models/
build_tiny_llama.py: 8 layers, hidden 1024, 16 heads, 4 KV heads of 64, bf16), sized so that
recomputing a 4096-token prompt takes seconds on this CPU. Every figure comes from one run:
one daemon (``kvfabric serve`` on a temporary data dir) and two engine jobs run one after
the other by tests/e2e/vllm/engine_runner.py in subprocesses:

* job 1 (daemon up):
  ``plain`` (no connector) runs each prompt twice: the first is a **recompute**, the second a
  hit in vLLM's own **local prefix cache** (same engine, same prompt; vLLM reuses whole
  blocks only, so it recomputes the last 128-token block);
  ``store`` (connector, ``kv_both``) computes every prompt and saves its KV to the daemon;
  ``hit-dram`` (a fresh engine, connector, ``kv_both``) runs the same prompts: every prompt
  token but the last is loaded from the daemon's DRAM tier.
* the daemon is stopped with SIGTERM (it writes its memory-resident chunks to its SSD tier)
  and restarted on the same data dir: its memory tiers are empty;
* job 2: ``hit-ssd`` (a fresh engine, connector) runs the same prompts again: the chunks are
  read back from the SSD tier, which the daemon's ``/v1/stats`` must confirm (SSD hit
  tokens up by at least the loaded tokens, DRAM hit tokens unchanged).

Each engine first runs one warm-up prompt of the same kind (not counted): an engine's first
request pays one-off costs. The prompts are distinct random token sequences, so only the
intended cache can hit; every hit must report ``num_cached_tokens`` as expected.
``first_token_mismatches`` counts cached runs whose greedy first token differs from the
recompute's (with random weights a near-tie can flip between the 1-token step of a hit and
the full prefill; it should stay at or near 0).

* job 3, the connector's cost to the engine when it loads nothing (issue 19): a two-process
  engine (what ``vllm serve`` runs) with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` unset, eight engines
  in the order plain, saving, saving, plain, plain, saving, saving, plain (no connector / the
  connector, ``kv_both``, saving every chunk of prompts the fabric does not hold; every engine
  runs prompts of its own, so nothing is ever loaded; the ABBA order cancels a drift of the
  machine's speed over the job), each a warm-up prompt and then COST prompts of
  COST_PROMPT_TOKENS tokens, COST_MAX_TOKENS output tokens, one request at a time.
  ``step_time_with_connector_vs_without`` is the median over the saving engines of their
  median engine time per request (vLLM's ``prefill_s`` + ``decode_s``: first scheduled to
  last token) over the same for the plain engines; ``step_time_plain_vs_plain`` the same
  ratio between the two halves of the plain engines, the run's noise floor (an engine
  instance's speed varies by a percent or two here). ``logprob_max_abs_diff_no_load`` is the
  largest difference of a generated token's logprob between an engine and the plain engine
  run on the same prompts without (0: bit-identical), ``outputs_differing_no_load`` the
  requests whose tokens differ: every saving engine's prompts are also run by a plain one.
* job 4, what saving costs a cold engine serving shared-prefix prompts (issue 15): engines
  plain, saving, saving, plain (same two-process setup), each a warm-up and then prompts of
  its own: ``shared`` prefixes of SHARED_PREFIX_TOKENS tokens with distinct suffixes of
  SHARED_SUFFIX_TOKENS, shuffled, SHARED_MAX_TOKENS output tokens, one request at a time.
  ``save_overhead_vs_no_connector``: the saving engines' median generate() wall (summed over
  their prompts) over the plain engines' (target <= 1.10); ``save_overhead_plain_vs_plain``
  the second plain engine's over the first's (the noise floor).

TTFT is the runner's per-request ``engine_ttft_s``: vLLM's engine-core interval from the
request being queued to its first token (monotonic clock). It includes the connector's
lookup (``get_num_new_matched_tokens``, run while scheduling) and its loads, which
``prefill_s`` (first scheduled -> first token) would split off, and it leaves out the
frontend's input processing, which is the same in every case. Figures are medians over the
prompts. ``load_share_of_hit_ttft`` is the in-process connector's ``load_seconds`` (its
load thread: pin, wait, copy into the paged cache) summed over the hit engine's requests,
warm-up included, divided by the sum of those requests' TTFTs.

Run (``--quick``: 2 prompts per case, about two minutes; without it: 5)::

    python benchmarks/vllm_ttft.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr).
``--model-dir`` keeps the built model there (reused by later runs) instead of the temp dir.
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import median
from _runner import Benchmark, Outcome, model_dir_option, run_benchmark
from daemon_process import DaemonProcess
from engine_jobs import kvfabric_connector, load_model_builder, run_engine_job
# isort: on

import argparse
import json
import random
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = {
    "layers": 8,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 2816,
    "vocab": 2048,
}
PROMPT_TOKENS = 4096
MAX_MODEL_LEN = PROMPT_TOKENS + 256
BLOCK_SIZE = 128  # vLLM's CPU default
DAEMON = ["store.tiers.dram.capacity=1GiB", "store.tiers.ssd.capacity=2GiB"]
READY_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 900.0
COST_PROMPT_TOKENS = 1024
COST_MAX_TOKENS = 16
COST_ORDER = "PSSPPSSP"  # P: no connector, S: the connector saving (ABBA: drift cancels)
SHARED_ORDER = "PSSP"  # job 4
SHARED_PREFIX_TOKENS = 1024
SHARED_SUFFIX_TOKENS = 128
SHARED_MAX_TOKENS = 16

TARGETS: dict[str, tuple[str, float]] = {
    "ttft_hit_dram_vs_recompute": ("<=", 0.2),
    "ttft_hit_ssd_vs_recompute": ("<=", 0.3),
    "ttft_hit_dram_vs_local_prefix_cache": ("<=", 1.5),
    "load_share_of_hit_ttft": ("<=", 0.1),
    "step_time_with_connector_vs_without": ("<=", 1.03),
    "save_overhead_vs_no_connector": ("<=", 1.10),
    "logprob_max_abs_diff_no_load": ("<=", 0.0),
    "outputs_differing_no_load": ("<=", 0),
}

FIGURES: list[tuple[str, str]] = [
    ("ttft_hit_dram_vs_recompute", "fabric hit from DRAM, fresh engine / recompute"),
    ("ttft_hit_ssd_vs_recompute", "fabric hit from SSD (restarted daemon) / recompute"),
    ("ttft_hit_dram_vs_local_prefix_cache", "fabric hit from DRAM / vLLM local prefix-cache hit"),
    ("load_share_of_hit_ttft", "connector load_seconds / TTFT, DRAM-hit engine"),
    ("load_share_of_hit_ttft_ssd", "connector load_seconds / TTFT, SSD-hit engine"),
    (
        "step_time_with_connector_vs_without",
        "engine time per request, connector saving, nothing loaded / no connector",
    ),
    ("step_time_plain_vs_plain", "the same, plain engines against plain (noise floor)"),
    (
        "save_overhead_vs_no_connector",
        "cold engine, shared-prefix prompts: generate wall, connector / none",
    ),
    ("save_overhead_plain_vs_plain", "the same, plain against plain (noise floor)"),
    ("logprob_max_abs_diff_no_load", "largest |logprob difference|, connector vs none"),
    ("outputs_differing_no_load", "requests whose tokens differ, connector vs none"),
    ("ttft_recompute_s", "median engine TTFT, no connector, prompt not cached"),
    ("ttft_hit_dram_s", "median engine TTFT, fabric hit from DRAM"),
    ("ttft_hit_ssd_s", "median engine TTFT, fabric hit from SSD"),
    ("ttft_local_prefix_cache_s", "median engine TTFT, same prompt again, same engine"),
    ("load_ms_per_hit_dram", "connector load_seconds per DRAM-hit request, ms"),
    ("load_ms_per_hit_ssd", "connector load_seconds per SSD-hit request, ms"),
    ("ssd_hit_tokens", "SSD-tier hit tokens in /v1/stats during the SSD-hit job"),
    ("first_token_mismatches", "cached runs whose first token differs from the recompute's"),
    ("prompt_tokens", "tokens per prompt"),
    ("prompts", "measured prompts per case (plus one warm-up)"),
    ("model_layers", "random-weight Llama: layers"),
    ("model_hidden", "hidden size (16 heads, 4 KV heads, head_dim 64, bf16)"),
    ("kv_mib_per_prompt", "KV cache of one prompt, MiB"),
]


@dataclass(frozen=True)
class Settings:
    prompts: int  # measured prompts per case, each its own random sequence
    cost_prompts: int  # job 3: measured prompts per engine (plus a warm-up)
    shared: tuple[int, int]  # job 4: (prefixes, suffixes per prefix) per engine


QUICK = Settings(prompts=2, cost_prompts=4, shared=(3, 4))
FULL = Settings(prompts=5, cost_prompts=8, shared=(5, 6))


def build_model(model_dir: Path) -> Path:
    # a no-op when it is already built there
    return load_model_builder().build_tiny_llama(model_dir, **MODEL)


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, MODEL["vocab"]) for _ in range(tokens)]


def stop_for_restart(daemon: DaemonProcess) -> None:
    """SIGTERM: the daemon writes memory-resident chunks to its SSD tier, then exits."""
    code = daemon.stop(timeout=60.0)
    if code != 0:
        raise RuntimeError(f"the daemon exited {code} on SIGTERM")


def tier_hit_tokens(daemon: DaemonProcess) -> dict[str, int]:
    with urllib.request.urlopen(f"{daemon.http_url}/v1/stats", timeout=10) as response:
        stats = json.loads(response.read())
    return {t["kind"]: int(t["hit_tokens"]) for t in stats["tiers"]}


def run_job(workdir: Path, model: Path, engines: list[dict], **options: Any) -> dict:
    """One engine_runner job in a subprocess (own process group: vLLM children die with
    it), killed after JOB_TIMEOUT_S; ``options``: further job keys (``multiprocessing``,
    ``env``). Its engine records by name."""
    workdir.mkdir(parents=True)
    job = {
        "model": str(model),
        "scratch_dir": str(workdir / "scratch"),
        "engines": engines,
        **options,
    }
    run = run_engine_job(workdir, job, stall_s=JOB_TIMEOUT_S, deadline_s=JOB_TIMEOUT_S)
    failure = run.failure()
    if failure is not None:
        raise RuntimeError(failure)
    assert run.result is not None
    return {e["name"]: e for e in run.result["engines"]}


def engine(name: str, prompts: list[list[int]], kv: dict | None = None) -> dict:
    return {
        "name": name,
        "prompts": prompts,
        "max_tokens": 1,
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "kv_transfer_config": kv,
    }


def ttfts(record: dict, indexes: list[int]) -> list[float]:
    return [float(record["outputs"][i]["engine_ttft_s"]) for i in indexes]


def check_cached(record: dict, indexes: list[int], expected: int) -> None:
    got = [record["outputs"][i]["num_cached_tokens"] for i in indexes]
    if any(g != expected for g in got):
        raise RuntimeError(
            f"{record['name']}: cached tokens {got}, expected {expected} each: "
            "the case did not hit as intended"
        )


def first_tokens(record: dict, indexes: list[int]) -> list[list[int]]:
    return [record["outputs"][i]["token_ids"] for i in indexes]


def load_share(record: dict) -> tuple[float, float]:
    """(connector load seconds / sum of TTFTs, load seconds per request) over all requests."""
    totals = record.get("connector_totals")
    if not totals or "load_seconds" not in totals:
        raise RuntimeError(
            f"{record['name']}: no connector_totals.load_seconds (in-process "
            "engine with the kvfabric connector expected)"
        )
    count = len(record["outputs"])
    seconds = float(totals["load_seconds"])
    return seconds / sum(ttfts(record, list(range(count)))), seconds / count


def engine_seconds(record: dict) -> list[float]:
    """Per request: first scheduled -> last token (vLLM's prefill_s + decode_s)."""
    return [float(o["prefill_s"]) + float(o["decode_s"] or 0.0) for o in record["outputs"]]


def logprob_diff(a: dict, b: dict) -> tuple[float, int]:
    """Largest |logprob difference| of the tokens two runs of the same prompts list (up to
    a request's first differing token) and how many requests' tokens differ."""
    worst, differing = 0.0, 0
    for x, y in zip(a["outputs"], b["outputs"]):
        differing += x["token_ids"] != y["token_ids"]
        for tx, ty, lx, ly in zip(x["token_ids"], y["token_ids"], x["logprobs"], y["logprobs"]):
            worst = max([worst] + [abs(lx[t] - ly[t]) for t in lx.keys() & ly.keys()])
            if tx != ty:
                break
    return worst, differing


def abba_job(
    root: Path, name: str, model: Path, kv: dict, order: str, spec: Callable[[int, int], dict]
) -> tuple[dict, list[str], list[str]]:
    """Two-process engines in ``order`` (P: no connector, S: the connector, ``kv``), with
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` unset (the user's default); ``spec(i, k)``: the i-th
    engine's prompts and options (k: how many of its kind came before it). Returns the job's
    records by name and the plain and the saving engines' names, in order."""
    engines, plain, saving = [], [], []
    for i, kind in enumerate(order):
        k = order[:i].count(kind)
        engine_name = f"{'saving' if kind == 'S' else 'plain'}-{k}"
        (saving if kind == "S" else plain).append(engine_name)
        engines.append(
            {"name": engine_name, **spec(i, k), "kv_transfer_config": kv if kind == "S" else None}
        )
    job = run_job(
        root / name,
        model,
        engines,
        multiprocessing=True,
        env={"VLLM_CPU_NUM_OF_RESERVED_CPU": None},
    )
    return job, plain, saving


def connector_cost(root: Path, model: Path, kv: dict, n: int) -> dict[str, Any]:
    """Job 3: the connector saving and loading nothing against no connector, engines in
    COST_ORDER. The k-th saving engine runs the k-th plain engine's prompts (its logprobs
    must be the same), which no other saving engine runs (so nothing is loaded)."""
    job, plain_runs, saving_runs = abba_job(
        root,
        "job3",
        model,
        kv,
        COST_ORDER,
        lambda _, k: {
            "prompts": [prompt(3000 + 100 * k + j, COST_PROMPT_TOKENS) for j in range(n + 1)],
            "max_tokens": COST_MAX_TOKENS,
            "logprobs": 1,
        },
    )
    # [0]: the warm-up
    plain = [median(engine_seconds(job[name])[1:]) for name in plain_runs]
    saving = [median(engine_seconds(job[name])[1:]) for name in saving_runs]
    diffs = [logprob_diff(job[f"plain-{k}"], job[f"saving-{k}"]) for k in range(len(saving))]
    return {
        "step_time_with_connector_vs_without": median(saving) / median(plain),
        "step_time_plain_vs_plain": median(plain[1::2]) / median(plain[0::2]),
        "logprob_max_abs_diff_no_load": max(d for d, _ in diffs),
        "outputs_differing_no_load": sum(c for _, c in diffs),
        "engine_seconds_per_request": {"plain": plain, "saving": saving},
    }


def shared_prefix_prompts(seed: int, prefixes: int, suffixes: int) -> list[list[int]]:
    """``prefixes`` x ``suffixes`` prompts (a shared prefix, a distinct suffix), shuffled."""
    rng = random.Random(seed)
    heads = [prompt(seed * 1000 + p, SHARED_PREFIX_TOKENS) for p in range(prefixes)]
    prompts = [
        head + [rng.randrange(10, MODEL["vocab"]) for _ in range(SHARED_SUFFIX_TOKENS)]
        for head in heads
        for _ in range(suffixes)
    ]
    rng.shuffle(prompts)
    return prompts


def save_overhead(root: Path, model: Path, kv: dict, shared: tuple[int, int]) -> dict[str, Any]:
    """Job 4: what saving costs a cold engine that serves shared-prefix prompts (the first
    prompt of a prefix computes and saves it, the later ones hit vLLM's own prefix cache
    and save their suffix's chunks), against no connector, engines in SHARED_ORDER. Every
    engine runs prompts of its own (nothing is loaded: the fabric is cold for each saving
    engine); a warm-up prompt first. The figure is the generate() walls' sum."""
    job, plain_runs, saving_runs = abba_job(
        root,
        "job4",
        model,
        kv,
        SHARED_ORDER,
        lambda i, _: {
            "prompts": [
                prompt(40 + 10 * i + 5, 256),
                *shared_prefix_prompts(40 + 10 * i, *shared),
            ],
            "max_tokens": SHARED_MAX_TOKENS,
        },
    )

    def wall(name: str) -> float:
        return sum(float(o["generate_s"]) for o in job[name]["outputs"][1:])  # [0]: warm-up

    plain, saving = [wall(n) for n in plain_runs], [wall(n) for n in saving_runs]
    return {
        "save_overhead_vs_no_connector": median(saving) / median(plain),
        "save_overhead_plain_vs_plain": plain[1] / plain[0],
        "save_overhead_walls_s": {"plain": plain, "saving": saving},
        "save_overhead_connector_totals": [
            job[n]["connector_totals"] for n in plain_runs + saving_runs
        ],
    }


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    model = build_model(args.model_dir or root / "model")
    n = cfg.prompts
    warm, measured = prompt(1000), [prompt(i) for i in range(n)]
    hit_prompts = [warm, *measured]  # index 0: warm-up
    hits = list(range(1, n + 1))
    # plain: warm-up, then each prompt twice (recompute, then local prefix-cache hit)
    plain_prompts = [prompt(2000)] + [p for p in measured for _ in range(2)]
    recompute_at, local_at = list(range(1, 2 * n, 2)), list(range(2, 2 * n + 1, 2))

    daemon = DaemonProcess(root / "daemon", DAEMON).start(READY_TIMEOUT_S)
    try:
        kv = kvfabric_connector(daemon.socket)
        job1 = run_job(
            root / "job1",
            model,
            [
                engine("plain", plain_prompts),
                engine("store", hit_prompts, kv),
                engine("hit-dram", hit_prompts, kv),
            ],
        )
        stop_for_restart(daemon)  # memory-resident chunks go to the SSD tier
        daemon.start(READY_TIMEOUT_S)
        before = tier_hit_tokens(daemon)
        job2 = run_job(root / "job2", model, [engine("hit-ssd", hit_prompts, kv)])
        after = tier_hit_tokens(daemon)
        cost = connector_cost(root, model, kv, cfg.cost_prompts)
        cost.update(save_overhead(root, model, kv, cfg.shared))
    finally:
        daemon.kill()

    plain, store, dram, ssd = job1["plain"], job1["store"], job1["hit-dram"], job2["hit-ssd"]
    full_blocks = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    check_cached(plain, recompute_at, 0)
    check_cached(plain, local_at, full_blocks)
    check_cached(store, hits, 0)
    check_cached(dram, hits, PROMPT_TOKENS - 1)
    check_cached(ssd, hits, PROMPT_TOKENS - 1)
    reference = first_tokens(plain, recompute_at)
    mismatches = sum(
        a != b
        for record, at in ((plain, local_at), (dram, hits), (ssd, hits))
        for a, b in zip(first_tokens(record, at), reference)
    )
    ssd_hits = after.get("ssd", 0) - before.get("ssd", 0)
    dram_hits = after.get("dram", 0) - before.get("dram", 0)
    loaded = (n + 1) * (PROMPT_TOKENS - 1)
    if ssd_hits < loaded or dram_hits != 0:
        raise RuntimeError(
            f"the SSD-hit job did not read from SSD: tier hit tokens {before} "
            f"-> {after}, {loaded} tokens loaded"
        )

    recompute = median(ttfts(plain, recompute_at))
    local = median(ttfts(plain, local_at))
    hit_dram = median(ttfts(dram, hits))
    hit_ssd = median(ttfts(ssd, hits))
    share_dram, per_req_dram = load_share(dram)
    share_ssd, per_req_ssd = load_share(ssd)
    kv_bytes = 2 * MODEL["layers"] * MODEL["kv_heads"] * MODEL["head_dim"] * 2 * PROMPT_TOKENS
    figures = {
        **cost,
        "ttft_hit_dram_vs_recompute": hit_dram / recompute,
        "ttft_hit_ssd_vs_recompute": hit_ssd / recompute,
        "ttft_hit_dram_vs_local_prefix_cache": hit_dram / local,
        "load_share_of_hit_ttft": share_dram,
        "load_share_of_hit_ttft_ssd": share_ssd,
        "ttft_recompute_s": recompute,
        "ttft_hit_dram_s": hit_dram,
        "ttft_hit_ssd_s": hit_ssd,
        "ttft_local_prefix_cache_s": local,
        "load_ms_per_hit_dram": per_req_dram * 1e3,
        "load_ms_per_hit_ssd": per_req_ssd * 1e3,
        "ssd_hit_tokens": ssd_hits,
        "first_token_mismatches": mismatches,
        "prompt_tokens": PROMPT_TOKENS,
        "prompts": n,
        "model_layers": MODEL["layers"],
        "model_hidden": MODEL["hidden"],
        "kv_mib_per_prompt": kv_bytes / (1 << 20),
        "ttft_measure": "engine_ttft_s",
        "ttfts_s": {
            "recompute": ttfts(plain, recompute_at),
            "local_prefix_cache": ttfts(plain, local_at),
            "hit_dram": ttfts(dram, hits),
            "hit_ssd": ttfts(ssd, hits),
        },
        "connector_totals": {
            "hit_dram": dram["connector_totals"],
            "hit_ssd": ssd["connector_totals"],
        },
    }
    return Outcome(figures)


BENCH = Benchmark(
    __doc__,
    "kvfabric-vllm-ttft-",
    TARGETS,
    FIGURES,
    quick_help=f"{QUICK.prompts} prompts per case instead of {FULL.prompts}",
    add_arguments=model_dir_option,
)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
