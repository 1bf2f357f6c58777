"""Run real vLLM engines on a local model, driven by a JSON job; write a JSON result.

    python tests/e2e/vllm/engine_runner.py JOB.json RESULT.json

While it runs it appends one JSON line per step (vllm imported, an engine built, a prompt
generated) to RESULT.progress, so a parent can tell a slow job from a stalled one.

Meant to run as a subprocess of the tests (vLLM leaves threads, sockets and global state behind,
and its multiprocessing switch is read at import time). The engines of a job run one after
another in this process: each gets a fresh `vllm.LLM`, runs its prompts, and is shut down and
deleted before the next one is built.

Job (JSON object; only `model`, `scratch_dir` and `engines[].prompts` are required):

    model            str   model directory (tests/models/build_tiny_llama.py)
    scratch_dir      str   TMPDIR, VLLM_RPC_BASE_PATH and VLLM_CACHE_ROOT go under it
    multiprocessing  bool  VLLM_ENABLE_V1_MULTIPROCESSING (default false: in-process engine)
    env              {str: str | null}  extra environment (e.g. a daemon socket), set before
                           vllm import; it may override the defaults below (null unsets one)
    engines          list of:
      name                    str   (default "engine<i>")
      kv_transfer_config      dict | null  keyword arguments of vllm.config.KVTransferConfig
      block_size              int   (default 128; a multiple of 32 on the CPU)
      max_num_batched_tokens  int | null  (set it below the prompt length for chunked prefill)
      enable_prefix_caching   bool  (default true)
      max_model_len           int   (default 4096)
      max_num_seqs            int | null
      dtype                   str   (default "bfloat16")
      seed                    int   (default 0)
      enforce_eager           bool  (default true)
      llm_kwargs              dict  further keyword arguments of vllm.LLM
      prompts                 list[list[int]]  token ids
      max_tokens              int | list[int]  (default 8; a list gives one value per prompt)
      ignore_eos              bool  (default true: every output has max_tokens tokens)
      logprobs                int | null  top-k logprobs per generated token (default none)
      kv_transfer_params      list[dict | null]  one per prompt (SamplingParams.extra_args
                              ["kv_transfer_params"], what vLLM 0.32 reads it from)
      kv_transfer_params_from str  name of an earlier engine of the job: each prompt also gets
                              the kv_transfer_params that engine returned for it (prefill ->
                              decode); keys given in kv_transfer_params win
      cache_salt              str | list[str | null]  per prompt (tenant isolation)
      batch                   bool  (default false: one generate() call per prompt, in order,
                              so a later prompt sees the KV of earlier ones; true: one call for
                              all prompts)
      reset_prefix_cache_after  list[int]  prompt indexes after whose generate() the engine's
                              local prefix cache is reset (sequential mode only)

Result (JSON object):

    ok               bool  false if an exception ended the job (then `error`, `traceback`)
    vllm_version     str
    multiprocessing  bool
    import_s         float  time to import vllm
    engines          list of:
      name, build_s (LLM constructor), shutdown_s, generate_s (sum of the generate() walls)
      hybrid_kv_cache_manager  bool  vLLM's hybrid KV cache manager (HMA) is on
      kv_cache_groups  list | null  in-process engines: per KV cache group, {"spec": its
                        class name, "layers": layer names, "sliding_window": int | null}
      connector_totals  dict | null  in-process engines with a connector that reports them
                        (KVFabricConnector.transfer_totals): loaded/saved chunks, errors, ...
      outputs        list, one per prompt, in prompt order:
        token_ids           list[int]  generated ids
        text                str
        finish_reason       str
        num_cached_tokens   int   prompt tokens not computed by this engine (local prefix cache
                                  plus tokens loaded by a KV connector)
        num_prompt_tokens   int
        kv_transfer_params  dict | null  as returned by the connector's request_finished
        generate_s          float  wall of the generate() call that ran this prompt (the whole
                                   batch's wall with batch=true)
        ttft_s              float | null  frontend: arrival -> first token processed
                                   (RequestOutput.metrics.first_token_latency)
        engine_ttft_s       float | null  engine core: queued -> first token (monotonic clock,
                                   includes the connector's get_num_new_matched_tokens and
                                   loads, excludes the frontend)
        queued_s            float | null  engine core: queued -> first scheduled
        prefill_s           float | null  engine core: first scheduled -> first token
        decode_s            float | null  engine core: first token -> last token
        logprobs            list[dict[str, float]] | null  with `logprobs`: per generated
                                   token, token id (as a string) -> logprob, the chosen
                                   token and the top-k
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "tests" / "support"))  # run as a script
from vllm_env import engine_env  # noqa: E402

_CLEANUP: list[Path] = []  # removed before exiting (os._exit skips atexit)
_PROGRESS: list[Path] = []  # RESULT.progress: one JSON line per step, for the parent's deadline


def progress(event: str, **fields: object) -> None:
    """Append one line to the progress file: the parent kills a job only when these stop
    coming (a stall), so a slow but moving job on a loaded machine still finishes."""
    for path in _PROGRESS:
        with open(path, "a") as out:
            out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def _setup_env(job: dict) -> None:
    env = engine_env(Path(job["scratch_dir"]).resolve())
    _CLEANUP.append(Path(env["VLLM_RPC_BASE_PATH"]))
    multiprocessing = bool(job.get("multiprocessing", False))
    env |= {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "PYTHONFAULTHANDLER": "1",  # and in vLLM's child processes
    }
    if not multiprocessing:
        env["OMP_NUM_THREADS"] = "1"
    extra = job.get("env") or {}
    env.update({str(k): str(v) for k, v in extra.items() if v is not None})
    os.environ.update(env)
    for name in (str(k) for k, v in extra.items() if v is None):
        os.environ.pop(name, None)
    # Connector modules (connectors.*, kvfabric.*) must import here and in vLLM's child
    # processes, whatever the start method.
    # (and this directory: the no-op control connector, ``noop_connector``)
    paths = [str(REPO_ROOT), str(Path(__file__).resolve().parent)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def _per_prompt(value, count: int, default):
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{len(value)} values for {count} prompts")
        return value
    return [value] * count


def _timing(metrics) -> dict:
    """Per-request latencies from RequestOutput.metrics (RequestStateStats in vLLM 0.32)."""
    empty = {
        "ttft_s": None,
        "engine_ttft_s": None,
        "queued_s": None,
        "prefill_s": None,
        "decode_s": None,
    }
    if metrics is None:
        return empty

    def interval(start: str, end: str) -> float | None:
        a, b = getattr(metrics, start, 0.0), getattr(metrics, end, 0.0)
        return b - a if a and b else None

    latency = getattr(metrics, "first_token_latency", 0.0)
    return {
        "ttft_s": latency or None,
        "engine_ttft_s": interval("queued_ts", "first_token_ts"),
        "queued_s": interval("queued_ts", "scheduled_ts"),
        "prefill_s": interval("scheduled_ts", "first_token_ts"),
        "decode_s": interval("first_token_ts", "last_token_ts"),
    }


def _output_record(output, generate_s: float) -> dict:
    completion = output.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "num_cached_tokens": int(output.num_cached_tokens or 0),
        "num_prompt_tokens": len(output.prompt_token_ids or []),
        "kv_transfer_params": output.kv_transfer_params,
        "generate_s": generate_s,
        "logprobs": None
        if completion.logprobs is None
        else [
            {str(token): float(entry.logprob) for token, entry in position.items()}
            for position in completion.logprobs
        ],
        **_timing(output.metrics),
    }


def _connector_totals() -> dict | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():  # two-process engine: the worker is elsewhere
        return None
    totals = getattr(get_kv_transfer_group(), "transfer_totals", None)
    return None if totals is None else totals()


def _kv_cache_groups(llm) -> dict:
    """Whether HMA is on, and (in-process engines) the KV cache groups it made."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process only
    groups = None
    if core is not None:
        groups = [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "layers": list(g.layer_names),
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
            }
            for g in core.scheduler.kv_cache_config.kv_cache_groups
        ]
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    return {
        "hybrid_kv_cache_manager": not scheduler.disable_hybrid_kv_cache_manager,
        "kv_cache_groups": groups,
    }


def _kv_params(spec: dict, count: int, previous: dict[str, dict]) -> list:
    own = _per_prompt(spec.get("kv_transfer_params"), count, None)
    source = spec.get("kv_transfer_params_from")
    if source is None:
        return own
    if source not in previous:
        raise ValueError(f"kv_transfer_params_from: no earlier engine named {source!r}")
    earlier = [o["kv_transfer_params"] for o in previous[source]["outputs"]]
    if len(earlier) != count:
        raise ValueError(f"{source!r} ran {len(earlier)} prompts, this engine {count}")
    return [{**(e or {}), **(o or {})} or None for e, o in zip(earlier, own)]


def _run_engine(spec: dict, index: int, model: str, previous: dict[str, dict]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    name = spec.get("name") or f"engine{index}"
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    max_tokens = _per_prompt(spec.get("max_tokens"), len(prompts), 8)
    params = _kv_params(spec, len(prompts), previous)
    salts = _per_prompt(spec.get("cache_salt"), len(prompts), None)
    inputs = [
        TokensPrompt(prompt_token_ids=p, cache_salt=salt)
        if salt
        else TokensPrompt(prompt_token_ids=p)
        for p, salt in zip(prompts, salts)
    ]
    ignore_eos = bool(spec.get("ignore_eos", True))
    logprobs = spec.get("logprobs")
    sampling = []
    for count, kv_params in zip(max_tokens, params):
        extra = {"kv_transfer_params": dict(kv_params)} if kv_params is not None else None
        sampling.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=int(count),
                ignore_eos=ignore_eos,
                extra_args=extra,
                logprobs=None if logprobs is None else int(logprobs),
            )
        )

    kwargs = {
        "model": model,
        "dtype": spec.get("dtype", "bfloat16"),
        "max_model_len": int(spec.get("max_model_len", 4096)),
        "block_size": int(spec.get("block_size", 128)),
        "enable_prefix_caching": bool(spec.get("enable_prefix_caching", True)),
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "seed": int(spec.get("seed", 0)),
        "disable_log_stats": False,
    }  # RequestOutput.metrics is None otherwise
    if spec.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
        kwargs["enable_chunked_prefill"] = True
    if spec.get("max_num_seqs") is not None:
        kwargs["max_num_seqs"] = int(spec["max_num_seqs"])
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    kwargs.update(spec.get("llm_kwargs") or {})

    started = time.perf_counter()
    progress("build", engine=name)
    llm = LLM(**kwargs)
    record: dict = {"name": name, "build_s": time.perf_counter() - started}
    record |= _kv_cache_groups(llm)
    progress("built", engine=name, build_s=record["build_s"])
    try:
        outputs: list[dict] = []
        if spec.get("batch", False):
            started = time.perf_counter()
            results = llm.generate(inputs, sampling, use_tqdm=False)
            record["generate_s"] = time.perf_counter() - started
            progress("batch", engine=name)
            outputs = [_output_record(r, record["generate_s"]) for r in results]
        else:
            reset_after = set(spec.get("reset_prefix_cache_after") or [])
            for i, (prompt, params_i) in enumerate(zip(inputs, sampling)):
                started = time.perf_counter()
                (result,) = llm.generate([prompt], [params_i], use_tqdm=False)
                outputs.append(_output_record(result, time.perf_counter() - started))
                progress("prompt", engine=name, index=i)
                if i in reset_after and not llm.reset_prefix_cache():
                    raise RuntimeError(f"reset_prefix_cache failed after prompt {i}")
            record["generate_s"] = sum(o["generate_s"] for o in outputs)
        record["outputs"] = outputs
        record["connector_totals"] = _connector_totals()
    finally:
        started = time.perf_counter()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        record["shutdown_s"] = time.perf_counter() - started
    return record


def run_job(job: dict) -> dict:
    _setup_env(job)
    result: dict = {
        "ok": False,
        "multiprocessing": bool(job.get("multiprocessing", False)),
        "engines": [],
    }
    try:
        started = time.perf_counter()
        import vllm

        result["import_s"] = time.perf_counter() - started
        progress("imported", import_s=result["import_s"])
        result["vllm_version"] = vllm.__version__
        previous: dict[str, dict] = {}
        for index, spec in enumerate(job["engines"]):
            record = _run_engine(spec, index, str(job["model"]), previous)
            previous[record["name"]] = record
            result["engines"].append(record)
        result["ok"] = True
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], file=sys.stderr, flush=True)
    return result


def main(argv: list[str]) -> int:
    faulthandler.enable()  # a crash in native code still shows where
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    _PROGRESS.append(Path(argv[1]).with_suffix(".progress"))
    result = run_job(job)
    tmp = Path(argv[1]).with_suffix(".partial")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM can leave non-daemon threads behind; do not let them hold the exit.
    for path in _CLEANUP:
        shutil.rmtree(path, ignore_errors=True)
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
