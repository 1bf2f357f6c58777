"""A vLLM CPU engine with KVFabricConnector through the chaos harness's faults, its every
output compared with the same engine's output without the connector.

Who calls what (:mod:`chaos_harness`, when ``Settings.engine`` is set; main thread):
:meth:`EngineRun.reference` then :meth:`EngineRun.start` first in ``setup``, before Redis and
the daemons (the harness's load and timing stay those of a run without an engine: its
workers start once the engine serves; the engine's connector reaches its daemon at its first
request, after the harness took the daemons' idle descriptor baseline), :meth:`EngineRun.drive`
last in ``setup``, :meth:`EngineRun.finish` first in ``figures`` (the engine must be gone
before the end-state checks count sessions and leases), :meth:`EngineRun.close` in
``teardown`` (idempotent). Two threads of its own run between ``drive`` and ``finish``: the
driver (requests, one at a time) and the stopper (SIGSTOP / SIGCONT of the engine's process
group); neither starts a process. Both engines run ``nice`` (``EngineSettings.nice``): in a
deployment an engine has cores of its own, here it would take one of the two the daemons'
latency figures are measured on.

What runs (:mod:`chaos_vllm`): the tiny test model (``tests/models/build_tiny_llama.py``),
in **float32**, vLLM's prefix cache off, one engine at a time:

* the **reference**: the OpenAI server without a connector; every prompt of the mix once;
* the **engine under test**: the same server and arguments plus KVFabricConnector
  (``kv_both``, ``kv_load_failure_policy: recompute``, 64-token chunks) on one daemon of the
  harness (``EngineSettings.node``; node-b, the one every schedule kills and stops) with a
  tenant token. With the prefix cache off every prompt token the engine does not compute was
  loaded from the fabric, so the responses' ``cached_tokens`` are fabric hits.

The mix: ``prefixes`` x ``suffixes`` prompts sharing long prefixes, the first pass grouped
by prefix (later prompts of a group hit the prefix), then passes in a shuffled order (whole
prompts hit, one token short), until ``finish``; greedy, ``max_tokens`` tokens with top-k
logprobs. The stopper freezes the engine (API server and engine core) for ``stop_s`` every
``stop_every_s`` once the first pass is done; the harness's faults (kill -9 and restart,
SIGSTOP / SIGCONT of the engine's daemon, Redis restarted empty) hit the fabric meanwhile.

Figures (``finish``):

* ``engine_outputs_identical`` -- every completed request generated the reference's tokens
  with the reference's logprobs (the chosen token's and the top-k), bit for bit. Sound in
  float32: loading a prefix from the fabric instead of computing it leaves the engine's
  float32 logprobs unchanged bit for bit (measured on this mix, Intel Xeon, no faults: 0.0
  over 256- and 287-token loads), whereas in bfloat16 the moved split between loaded and
  computed tokens changes the computed part's batch shape and so its rounding (the same mix
  in bfloat16: 1 of 18 outputs with logprobs off by 0.058, and exact top-2 ties in the
  reference; the vLLM tests bound that instead: tests/support/logprob_bounds.py).
  ``engine_max_logprob_diff`` tells a rounding difference from wrong KV (which moves
  logprobs by whole units);
* ``engine_requests``, ``engine_requests_failed`` (no completion within the request
  deadline: the connector must recompute what it cannot load, never fail a request),
  ``engine_failure_samples``;
* ``engine_fabric_hit_tokens`` (sum of ``cached_tokens``), ``engine_requests_with_hits``,
  ``engine_hit_requests_after_daemon_restart`` (the connector found the restarted daemon);
* ``engine_requests_during_daemon_faults`` (requests in flight during a kill -9, SIGSTOP or
  Redis restart of the engine's daemon), ``engine_stops``;
* ``engine_reference_min_margin`` (the reference's smallest top-2 logprob gap: a greedy
  token cannot flip on float32 rounding), ``engine_start_s``.

Every result is also written to ``engine-results.jsonl`` (and the reference to
``engine-reference.json``), under the run's ``engine/`` directory, for :func:`load_results`
and :func:`differences`.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos_vllm import Completion, EngineError, Server, tiny_model

DAEMON_FAULTS = ("kill9", "sigstop", "redis_restart")


@dataclass(frozen=True)
class EngineSettings:
    node: str = "node-b"
    tenant: str = "b"
    prefixes: int = 3
    prefix_tokens: int = 256  # four 64-token chunks
    suffixes: int = 3
    suffix_tokens: int = 32  # a partial chunk: saved too
    max_tokens: int = 8
    top_k: int = 5
    chunk_tokens: int = 64  # 256 KiB float32 chunks: the harness's small tiers hold some
    block_size: int = 64
    stop_s: float = 3.0
    stop_every_s: float = 25.0
    seed: int = 11
    nice: int = 5


@dataclass(frozen=True)
class Result:
    index: int  # the prompt's
    t0: float  # monotonic
    t1: float
    completion: Completion | None
    error: str | None = None


def prompts(s: EngineSettings) -> list[list[int]]:
    rng = random.Random(s.seed)
    heads = [[rng.randrange(10, 2000) for _ in range(s.prefix_tokens)] for _ in range(s.prefixes)]
    return [
        head + [rng.randrange(10, 2000) for _ in range(s.suffix_tokens)]
        for head in heads
        for _ in range(s.suffixes)
    ]


def differences(reference: list[Completion], results: list[Result]) -> list[dict[str, Any]]:
    """The completed results whose tokens or logprobs are not the reference's, bit for bit."""
    out = []
    for r in results:
        if r.completion is None:
            continue
        want = reference[r.index]
        if (r.completion.token_ids, r.completion.logprobs) != (want.token_ids, want.logprobs):
            out.append(
                {
                    "index": r.index,
                    "want": list(want.token_ids),
                    "got": list(r.completion.token_ids),
                    "cached_tokens": r.completion.cached_tokens,
                    "max_logprob_diff": logprob_diff(want, r.completion),
                }
            )
    return out


def logprob_diff(a: Completion, b: Completion) -> float:
    """The largest logprob difference over the tokens both list, position by position."""
    return max(
        (abs(x[t] - y[t]) for x, y in zip(a.logprobs, b.logprobs) for t in x if t in y),
        default=0.0,
    )


def top2_margin(c: Completion) -> float:
    gaps = [
        top[0] - top[1]
        for top in (sorted(lp.values(), reverse=True) for lp in c.logprobs)
        if len(top) > 1
    ]
    return min(gaps, default=float("inf"))


def _completion_json(c: Completion) -> dict[str, Any]:
    return {**asdict(c), "logprobs": [{str(k): v for k, v in lp.items()} for lp in c.logprobs]}


def _completion(data: dict[str, Any]) -> Completion:
    return Completion(
        tuple(data["token_ids"]),
        tuple({int(k): v for k, v in lp.items()} for lp in data["logprobs"]),
        data["cached_tokens"],
    )


def load_results(workdir: Path) -> tuple[list[Completion], list[Result]]:
    """The reference and every result a run in ``workdir`` wrote."""
    workdir = workdir / "engine"
    reference = [
        _completion(c) for c in json.loads((workdir / "engine-reference.json").read_text())
    ]
    results = []
    for line in (workdir / "engine-results.jsonl").read_text().splitlines():
        r = json.loads(line)
        done = None if r["completion"] is None else _completion(r["completion"])
        results.append(Result(r["index"], r["t0"], r["t1"], done, r["error"]))
    return reference, results


class EngineRun:
    def __init__(self, s: EngineSettings, workdir: Path, token: str, salt: str) -> None:
        """``token``: a tenant token of the harness's cluster; ``salt``: its tenant's salt,
        every request's ``cache_salt``. Files go to ``workdir/engine``."""
        self.s, self.token, self.salt = s, token, salt
        self.workdir = workdir / "engine"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prompts = prompts(s)
        self.ref: list[Completion] = []
        self.results: list[Result] = []
        self.stops: list[tuple[float, float]] = []
        self.first_pass = threading.Event()
        self.halt = threading.Event()
        self.threads: list[threading.Thread] = []
        self.engine: Server | None = None
        self.start_s: dict[str, float | None] = {}

    def _args(self) -> list[str]:
        return [
            "--dtype",
            "float32",
            "--block-size",
            str(self.s.block_size),
            "--no-enable-prefix-caching",
            "--max-model-len",
            str(self.s.prefix_tokens + self.s.suffix_tokens + self.s.max_tokens + 64),
        ]

    def reference(self) -> None:
        """The reference engine (no connector): every prompt once, then it is gone."""
        model = tiny_model(self.workdir)
        server = Server("vllm-reference", model, self._args(), self.workdir, self.s.nice)
        try:
            server.start(deadline_s=None)
            took = []
            for prompt in self.prompts:
                t0 = time.monotonic()
                self.ref.append(self._complete(server, prompt, timeout=server.later_deadline_s()))
                took.append(time.monotonic() - t0)
        finally:
            server.kill()
        self.model, self.start_deadline_s = model, server.later_deadline_s()
        self.start_s["reference"] = server.start_s
        # a request may wait out the connector's deadlines (a stopped daemon), a stopped
        # engine, and compute several times slower than on the idle machine
        self.request_timeout_s = 2 * 10.0 + self.s.stop_s + 20 * max(took)
        (self.workdir / "engine-reference.json").write_text(
            json.dumps([_completion_json(c) for c in self.ref])
        )

    def start(self, socket: str) -> None:
        """The engine under test, for the daemon at ``socket`` (which may not serve yet)."""
        connector = {
            "kv_connector": "KVFabricConnector",
            "kv_connector_module_path": "kvfabric_connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "socket_path": socket,
                "token": self.token,
                "model_id": "chaos-engine",
                "chunk_tokens": self.s.chunk_tokens,
            },
        }
        args = [*self._args(), "--kv-transfer-config", json.dumps(connector)]
        self.engine = Server("vllm-engine", self.model, args, self.workdir, self.s.nice)
        self.engine.start(deadline_s=self.start_deadline_s)
        self.start_s["engine"] = self.engine.start_s

    def drive(self) -> None:
        """The driver and the stopper, until :meth:`finish`."""
        for target in (self._drive, self._stopper):
            thread = threading.Thread(target=target, name=f"engine-{target.__name__}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _complete(self, server: Server, prompt: list[int], timeout: float) -> Completion:
        return server.complete(prompt, self.salt, self.s.max_tokens, self.s.top_k, timeout)

    def _drive(self) -> None:
        assert self.engine is not None
        rng = random.Random(self.s.seed)
        order = list(range(len(self.prompts)))
        with open(self.workdir / "engine-results.jsonl", "a") as log:
            while not self.halt.is_set():
                for index in order:
                    if self.halt.is_set():
                        break
                    t0 = time.monotonic()
                    try:
                        done = self._complete(
                            self.engine, self.prompts[index], self.request_timeout_s
                        )
                        result = Result(index, t0, time.monotonic(), done)
                    except EngineError as exc:
                        result = Result(index, t0, time.monotonic(), None, str(exc))
                    self.results.append(result)
                    record = {**asdict(result), "completion": None}
                    if done := result.completion:
                        record["completion"] = _completion_json(done)
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                self.first_pass.set()
                rng.shuffle(order)

    def _stopper(self) -> None:
        assert self.engine is not None and self.engine.child is not None
        self.first_pass.wait()
        while not self.halt.wait(self.s.stop_every_s):
            t0 = time.monotonic()
            self.engine.child.signal(signal.SIGSTOP)
            time.sleep(self.s.stop_s)
            self.engine.child.signal(signal.SIGCONT)
            self.stops.append((t0, time.monotonic()))

    def finish(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Stop driving (the request in flight completes), end the engine, every figure.
        ``records``: the harness's fault records (kind, node, t0, t1)."""
        self.halt.set()
        self.first_pass.set()  # a stopper still waiting for it ends at once
        for thread in self.threads:
            thread.join(self.request_timeout_s + self.s.stop_s + 10)
        self.close()
        done = [r for r in self.results if r.completion is not None]
        failed = [r for r in self.results if r.completion is None]
        differing = differences(self.ref, self.results)
        faults = [
            (r["t0"], r["t1"])
            for r in records
            if r["kind"] in DAEMON_FAULTS and r["node"] in (self.s.node, None)
        ]
        kills = [r["t1"] for r in records if r["kind"] == "kill9" and r["node"] == self.s.node]
        return {
            "engine_outputs_identical": bool(done) and not differing,
            "engine_requests": len(self.results),
            "engine_requests_failed": len(failed),
            "engine_failure_samples": [f"{r.index}: {r.error}" for r in failed[:5]],
            "engine_outputs_differing": len(differing),
            "engine_differing_samples": differing[:5],
            "engine_max_logprob_diff": max(
                (logprob_diff(self.ref[r.index], r.completion) for r in done if r.completion),
                default=None,
            ),
            "engine_fabric_hit_tokens": sum(
                r.completion.cached_tokens for r in done if r.completion
            ),
            "engine_requests_with_hits": sum(
                1 for r in done if r.completion and r.completion.cached_tokens
            ),
            "engine_hit_requests_after_daemon_restart": sum(
                1
                for r in done
                if kills and r.t0 > min(kills) and r.completion and r.completion.cached_tokens
            ),
            "engine_requests_during_daemon_faults": sum(
                1 for r in self.results if any(r.t0 <= t1 and r.t1 >= t0 for t0, t1 in faults)
            ),
            "engine_stops": len(self.stops),
            "engine_reference_min_margin": min(top2_margin(c) for c in self.ref),
            "engine_start_s": {k: round(v, 1) for k, v in self.start_s.items() if v is not None},
        }

    def close(self) -> None:
        self.halt.set()
        if self.engine is not None:
            self.engine.kill()
