"""Measure an engine's step-time profile (:class:`kvfabric.sim.engine.EngineProfile`) by
driving a running OpenAI-compatible vLLM server (``kvfabric plan calibrate --url``).

Prefill: prompts of several lengths (random token ids, so no prefix cache serves them), one
output token, streamed, one at a time; the time to the first token, median of ``repeats``, fitted
by least squares to ``base + per_token * n``: the fixed part holds what every request pays
around its prefill step (HTTP, scheduling, the first sampling), which is what a client's TTFT
holds too. Decode: ``batch`` streams at once (short prompts, ``ignore_eos``, ``decode_tokens``
tokens each, after one run of each size and batch left out: a new shape's first time costs
more); per batch size, the median over streams of the mean spacing of a stream's
tokens in the middle of the run (both ends trimmed: streams start and end apart; tokens may
reach the client in bursts, so single gaps say little), median of ``repeats`` runs (one run
read a 2-vCPU engine's step anywhere from 2.7 to 4.8 ms), fitted to ``base + per_seq * batch``.

Measures what the engine does when nothing else runs on it: call it on an idle engine. A
failed request raises :class:`CalibrationError` with the engine's answer. Blocking (httpx).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from kvfabric.sim.engine import EngineProfile

PREFILL_SIZES = (16, 64, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8)


class CalibrationError(RuntimeError):
    """The engine did not answer a calibration request as expected."""


@dataclass(frozen=True)
class Calibration:
    profile: EngineProfile
    prefill_s: dict[int, float]  # prompt tokens -> median request seconds
    decode_step_s: dict[int, float]  # batch -> median seconds between a stream's tokens


def calibrate(
    url: str,
    model: str,
    name: str,
    *,
    vocab: int,
    cost_per_hour: float = 0.0,
    prefill_sizes: Sequence[int] = PREFILL_SIZES,
    batches: Sequence[int] = DECODE_BATCHES,
    repeats: int = 3,
    decode_tokens: int = 48,
    timeout_s: float = 120.0,
    seed: int = 0,
) -> Calibration:
    rng = random.Random(seed)
    base = url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as http:
        prefill = {}
        for n in prefill_sizes:
            _timed(http, base, model, _tokens(rng, vocab, n))  # a new shape's first time
            prefill[n] = statistics.median(
                _timed(http, base, model, _tokens(rng, vocab, n)) for _ in range(repeats)
            )
    decode = {}
    for b in batches:
        _decode_gap(base, model, rng, vocab, b, decode_tokens, timeout_s)  # first time, too
        decode[b] = statistics.median(
            _decode_gap(base, model, rng, vocab, b, decode_tokens, timeout_s)
            for _ in range(repeats)
        )
    p_base, p_slope = _fit(prefill)
    d_base, d_slope = _fit(decode)
    profile = EngineProfile(
        name,
        prefill_base_s=max(0.0, p_base),
        prefill_s_per_token=max(0.0, p_slope),
        decode_base_s=max(0.0, d_base),
        decode_s_per_seq=max(0.0, d_slope),
        cost_per_hour=cost_per_hour,
    )
    return Calibration(profile, prefill, decode)


def warm(url: str, model: str, vocab: int, timeout_s: float) -> None:
    """Prompts of a few sizes, then a few streams at once: an engine's first prefill of a
    shape and first decode of a batch size pay one-time costs (kernels, caches)."""
    rng = random.Random(7)
    base = url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as http:
        for n in (16, 64, 256, 512):
            _complete(http, base, model, _tokens(rng, vocab, n), 8)
    for batch in (2, 4):
        _decode_gap(base, model, rng, vocab, batch, 24, timeout_s)


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares intercept and slope of seconds over size."""
    x = np.array(list(points), dtype=float)
    y = np.array(list(points.values()), dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }


def _complete(http: httpx.Client, base: str, model: str, prompt: list[int], n: int) -> None:
    answer = http.post(f"{base}/v1/completions", json=_body(model, prompt, n, False))
    if answer.status_code != 200:
        raise CalibrationError(f"{base}: {answer.status_code} {answer.text[:300]}")


def _timed(http: httpx.Client, base: str, model: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token (a client's TTFT) of ``prompt``."""
    started = time.perf_counter()
    with http.stream("POST", f"{base}/v1/completions", json=_body(model, prompt, 1, True)) as a:
        if a.status_code != 200:
            a.read()
            raise CalibrationError(f"{base}: {a.status_code} {a.text[:300]}")
        for line in a.iter_lines():
            if carries_choices(line):
                return time.perf_counter() - started
    raise CalibrationError(f"{base}: a prompt of {len(prompt)} tokens streamed no token")


def _decode_gap(
    base: str, model: str, rng: random.Random, vocab: int, batch: int, tokens: int, timeout: float
) -> float:
    prompts = [_tokens(rng, vocab, 8) for _ in range(batch)]
    stamps: list[list[float]] = [[] for _ in range(batch)]
    errors: list[str] = []

    def stream(i: int) -> None:
        try:
            with httpx.Client(timeout=timeout) as http:
                body = _body(model, prompts[i], tokens, True)
                with http.stream("POST", f"{base}/v1/completions", json=body) as answer:
                    if answer.status_code != 200:
                        answer.read()
                        errors.append(f"{answer.status_code} {answer.text[:300]}")
                        return
                    for line in answer.iter_lines():
                        if carries_choices(line):
                            stamps[i].append(time.perf_counter())
        except httpx.HTTPError as exc:
            errors.append(str(exc) or type(exc).__name__)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise CalibrationError(f"{base}: decode batch {batch}: {errors[0]}")
    per_stream = []
    for times in stamps:
        # the middle half: every stream has started and none has ended; its mean spacing
        # (tokens can reach the client in bursts, so single gaps say little)
        middle = times[len(times) // 4 : 3 * len(times) // 4]
        if len(middle) >= 2:
            per_stream.append((middle[-1] - middle[0]) / (len(middle) - 1))
    if not per_stream:
        raise CalibrationError(f"{base}: decode batch {batch}: too few tokens streamed")
    return statistics.median(per_stream)


def carries_choices(line: str) -> bool:
    """An SSE line of a completion stream that carries output (not ``[DONE]``)."""
    return (
        line.startswith("data: ")
        and line != "data: [DONE]"
        and bool(json.loads(line[6:]).get("choices"))
    )
