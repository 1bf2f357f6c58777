"""Heterogeneous decode: KV that a vLLM (CPU) prefill put into the fabric, consumed by an
engine with another block size, by a model in another dtype, and by a plain transformers
decode loop (kvfabric_connectors.hf) on another node of the cluster.

Two real implementations meet here: vLLM's CPU kernels produced the stored KV, transformers
(eager PyTorch) produced the references. On this random-weight model (init_std 0.3) a bf16
rounding difference grows about 2x per layer, so the two never agree bit for bit past layer 0,
and greedy tokens may flip wherever a step's top two logits are close: transformers' own bf16
and fp32 runs of one prompt often differ from the first generated token on. The criteria are
therefore about magnitudes, each paired with a negative control (a layout mistake: heads
swapped, token-major read, K and V swapped, K before RoPE) that must miss them by far:

* stored K/V against transformers' KV of the same tokens, per layer: relative L2 error
  (``||a - b|| / ||b||``) at most ``KV_RTOL`` = 0.2 and at most twice transformers' own bf16-vs-
  fp32 error + 0.01 (two independent bf16 implementations each sit about that far from the
  fp32 result); at layer 0, where both start from the same bf16 embeddings, every element
  within two bf16 ulps of the layer's largest binade (0.25 for values up to 32). Measured
  over 11 prompts on one x86 machine: at most 0.003 / 0.030 / 0.057 / 0.081 for layers 0-3
  (transformers bf16 vs fp32: 0.004 / 0.039 / 0.071 / 0.101); layer 0 at most 0.125 (one
  ulp) off in K and bit-exact in V (no RoPE); every layout mistake gives 1.3-1.45 (about
  sqrt(2): uncorrelated tensors of one norm).
* a decode continuing from the fabric's KV against transformers' full-prompt greedy
  generation: teacher-forced along the reference's tokens (so one early flip does not change
  every later step), the logits of each of the first ``STEPS`` steps within relative L2 error
  ``LOGIT_RTOL`` = 0.5 of the reference's: no further than bf16 rounding takes transformers
  itself (its own bf16 first-step logits are up to 0.32 from its fp32 ones over 11 prompts).
  Measured over those 11 prompts: at most 0.25 (fp32 consumer) and 0.22 (bf16). A layout
  mistake must miss it at the median step by more than twice (measured medians 1.28-1.49;
  a single step can come closer, e.g. 0.32 for one token-major read, hence the median).
  Greedy tokens are reported, not asserted (see above).

Every engine runs in one engine_runner job (building the first vLLM engine of a process costs
~10-15 s); transformers runs in the test process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_jobs import kvfabric_connector

from kvfabric.client import Client
from kvfabric.convert import fp8
from kvfabric.convert.dtype import write_layer
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric_connectors.hf import (
    decode_from_fabric,
    greedy_decode,
    load_past_key_values,
    make_cache,
    namespace_for,
)

CHUNK = 256
PROMPT_LEN = 700  # two full chunks and a partial one of 188 tokens
STEPS = 8
KV_RTOL = 0.2
LOGIT_RTOL = 0.5
LAYOUT_MISTAKE = 1.0  # a layout mistake must be at least this far (relative L2) off
PREFILL, DECODE = "prefill-a", "decode-b"
MEASURED: dict[str, object] = {}  # printed when the module ends (pytest -s)


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


P = prompt(21)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against the reference ``b``."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def connector_namespace(model: Path, tenant: str = "") -> Namespace:
    """The namespace KVFabricConnector derives (model id = the served name = the path)."""
    config = json.loads((model / "config.json").read_text())
    spec = KVSpec(
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        dtype="bfloat16",
        chunk_tokens=CHUNK,
    )
    return Namespace(str(model), spec, tenant)


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nheterogeneous decode, measured:", json.dumps(MEASURED, indent=1))


@pytest.fixture(scope="module")
def nodes(shared_redis, start_module_daemon) -> dict:
    def node(name: str):
        return start_module_daemon(
            name,
            "store.tiers.dram.capacity=256MiB",
            "store.tiers.ssd.capacity=1GiB",
            f"node_id={name}",
            "cluster.index=redis",
            f"cluster.redis_url={shared_redis.url}",
            "cluster.heartbeat_s=0.2",
            "tcp.port=0",
            "cluster.transport=socket",
        )

    return {PREFILL: node(PREFILL), DECODE: node(DECODE)}


@pytest.fixture(scope="module")
def engines(nodes, job_runner, tmp_path_factory) -> dict:
    """A block-128 producer prefills P into the prefill node; a fresh block-256 consumer
    continues it from there; a block-256 engine without a connector runs it whole."""
    socket = nodes[PREFILL].socket
    result = job_runner(
        tmp_path_factory.mktemp("hetero"),
        {
            "engines": [
                {
                    "name": "producer",
                    "block_size": 128,
                    "prompts": [P],
                    "max_tokens": 1,
                    "kv_transfer_config": kvfabric_connector(role="kv_producer", socket=socket),
                },
                {
                    "name": "consumer-256",
                    "block_size": 256,
                    "prompts": [P],
                    "max_tokens": STEPS,
                    "kv_transfer_config": kvfabric_connector(role="kv_consumer", socket=socket),
                    "kv_transfer_params_from": "producer",
                },
                {"name": "monolithic-256", "block_size": 256, "prompts": [P], "max_tokens": STEPS},
            ]
        },
    )
    MEASURED["vllm_job_wall_s"] = round(result["wall_s"], 1)
    return result


@pytest.fixture(scope="module")
def ns(tiny_model) -> Namespace:
    from transformers import AutoConfig

    derived = namespace_for(
        str(tiny_model),
        AutoConfig.from_pretrained(tiny_model),
        dtype="bfloat16",
        chunk_tokens=CHUNK,
    )
    assert derived == connector_namespace(tiny_model)
    return derived


@pytest.fixture(scope="module")
def models(tiny_model) -> dict:
    from transformers import AutoModelForCausalLM

    return {
        dtype: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype).eval()
        for dtype in (torch.bfloat16, torch.float32)
    }


@pytest.fixture(scope="module")
def references(models) -> dict:
    """transformers' own greedy generation from the whole prompt: tokens and per-step logits."""
    out = {}
    ids = torch.tensor([P])
    for dtype, model in models.items():
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        out[dtype] = {
            "tokens": gen.sequences[0, len(P) :].tolist(),
            "logits": [step[0].float() for step in gen.logits],
        }
    return out


def teacher_forced_errors(model, reference: dict, cache, prefix: int) -> list[float]:
    """Relative L2 error of each step's logits, decoding from ``cache`` along the
    reference's tokens."""
    run = greedy_decode(
        model,
        P,
        STEPS,
        past_key_values=cache,
        prefix_tokens=prefix,
        teacher_tokens=reference["tokens"],
        return_logits=True,
    )
    return [rel(a, b) for a, b in zip(run.logits, reference["logits"])]


def prompt_part(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of the first PROMPT_LEN - 1 tokens of a cache."""
    n = PROMPT_LEN - 1
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]


def layout_mistakes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The same KV read with a layout mistake: heads in the wrong order (a TP rank mix-up),
    [token][head] read as [head][token], K and V swapped."""

    def token_major(x: torch.Tensor) -> torch.Tensor:
        _, heads, tokens, dim = x.shape
        return x.reshape(1, tokens, heads, dim).transpose(1, 2).contiguous()

    return {
        "heads swapped": [(k.flip(1), v.flip(1)) for k, v in layers],
        "token-major": [(token_major(k), token_major(v)) for k, v in layers],
        "k/v swapped": [(v, k) for k, v in layers],
    }


# --------------------------------------------------------------------------- (a) the oracle


def read_fabric(socket: str, ns: Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's canonical payloads, chunk by chunk with Client.get / layer_pieces:
    [layer][k|v][head][token][dim] concatenated over tokens, and the same bytes read as if
    each chunk's layer were [k|v][token][head][dim] (a layout mistake)."""
    spec = ns.spec
    heads, dim = spec.num_kv_heads, spec.head_dim
    right, wrong = [], []
    with Client(socket) as client:
        for ref in chunk_hashes(ns, P):
            with client.get(ns, ref.key) as reader:
                layers = []
                for layer in range(spec.num_layers):
                    reader.wait_layer(layer, timeout=10)
                    raw = torch.cat(
                        [torch.from_numpy(p.copy()) for p in reader.layer_pieces(layer)]
                    )
                    layers.append(raw.view(torch.bfloat16))
            flat = torch.stack(layers)  # [layer, bytes of one layer as bf16]
            right.append(flat.view(spec.num_layers, 2, heads, ref.num_tokens, dim))
            wrong.append(flat.view(spec.num_layers, 2, ref.num_tokens, heads, dim).transpose(2, 3))
    return torch.cat(right, dim=3), torch.cat(wrong, dim=3)


def test_oracle_stored_kv_matches_transformers_kv(engines, nodes, ns, models) -> None:
    assert engines.outputs("producer")[0]["kv_transfer_params"] == {
        "kvfabric": {"tokens": PROMPT_LEN}
    }
    stored, misread = read_fabric(nodes[PREFILL].socket, ns)
    assert stored.shape == (4, 2, 2, PROMPT_LEN, 64)
    ids = torch.tensor([P])
    with torch.inference_mode():
        hf16 = models[torch.bfloat16](ids, use_cache=True).past_key_values
        hf32 = models[torch.float32](ids, use_cache=True).past_key_values
        layer0 = models[torch.bfloat16].model.layers[0]
        hidden = layer0.input_layernorm(models[torch.bfloat16].model.embed_tokens(ids))
        k_before_rope = layer0.self_attn.k_proj(hidden).view(1, PROMPT_LEN, 2, 64).transpose(1, 2)
    errors, floor = [], []
    for layer in range(ns.spec.num_layers):
        ref = hf16.layers[layer]
        k, v = stored[layer, 0].unsqueeze(0), stored[layer, 1].unsqueeze(0)
        errors.append(max(rel(k, ref.keys), rel(v, ref.values)))
        floor.append(
            max(rel(ref.keys, hf32.layers[layer].keys), rel(ref.values, hf32.layers[layer].values))
        )
        assert errors[-1] <= KV_RTOL, (layer, errors, floor)
        assert errors[-1] <= 2 * floor[-1] + 0.01, (layer, errors, floor)
        mistakes = {
            "heads swapped": (k.flip(1), v.flip(1)),
            "k/v swapped": (v, k),
            "token-major": (misread[layer, 0].unsqueeze(0), misread[layer, 1].unsqueeze(0)),
        }
        for name, (mk, mv) in mistakes.items():
            off = min(rel(mk, ref.keys), rel(mv, ref.values))
            assert off > LAYOUT_MISTAKE, (layer, name, off)
            MEASURED.setdefault("oracle_layout_mistake_min", {})[name] = round(
                min(off, MEASURED.get("oracle_layout_mistake_min", {}).get(name, 9.0)), 3
            )
    # layer 0: the same bf16 embeddings in, one rounding apart out
    for stored_x, ref_x in (
        (stored[0, 0], hf16.layers[0].keys[0]),
        (stored[0, 1], hf16.layers[0].values[0]),
    ):
        ulps = 2 * 2.0 ** (math.floor(math.log2(float(ref_x.float().abs().max()))) - 7)
        assert float((stored_x.float() - ref_x.float()).abs().max()) <= ulps
    # vLLM stores K after the rotary embedding, as transformers caches it
    assert rel(stored[0, 0].unsqueeze(0), k_before_rope) > LAYOUT_MISTAKE / 2
    MEASURED["oracle_kv_rel_error_per_layer"] = [round(e, 4) for e in errors]
    MEASURED["transformers_bf16_vs_fp32_kv_rel_per_layer"] = [round(e, 4) for e in floor]
    MEASURED["layer0_k_max_abs_error"] = float(
        (stored[0, 0].float() - hf16.layers[0].keys[0].float()).abs().max()
    )
    MEASURED["k_before_rope_rel"] = round(rel(stored[0, 0].unsqueeze(0), k_before_rope), 3)


# ---------------------------------------------------------------- (b) another block size


def test_block_256_consumer_continues_a_block_128_prefill(engines) -> None:
    (consumer,) = engines.outputs("consumer-256")
    (monolithic,) = engines.outputs("monolithic-256")
    (producer,) = engines.outputs("producer")
    assert consumer["num_cached_tokens"] == PROMPT_LEN - 1  # only the last token computed
    totals = next(e for e in engines["engines"] if e["name"] == "consumer-256")
    assert totals["connector_totals"]["loaded_tokens"] == PROMPT_LEN - 1
    assert consumer["token_ids"] == monolithic["token_ids"]
    assert producer["token_ids"] == monolithic["token_ids"][:1]


# ------------------------------------------------------------- (c) a consumer in fp32


def test_fp32_consumer_continues_from_bf16_kv(engines, nodes, ns, models, references) -> None:
    model, reference = models[torch.float32], references[torch.float32]
    with Client(nodes[PREFILL].socket) as client:
        as_stored = load_past_key_values(client, ns, P, max_tokens=PROMPT_LEN - 1)
        run = decode_from_fabric(
            client, ns, model, P, STEPS, teacher_tokens=reference["tokens"], return_logits=True
        )
        free = decode_from_fabric(client, ns, model, P, STEPS)
    assert run.fabric is not None and run.fabric.num_tokens == PROMPT_LEN - 1
    assert run.prefix_tokens == PROMPT_LEN - 1 and run.computed_tokens == 1
    # bf16 -> fp32 is exact: the fp32 cache is the stored bf16 values, widened (the decode
    # went on appending to the cache it was given: its first PROMPT_LEN - 1 tokens are those)
    widened = prompt_part(run.fabric.past_key_values)
    for (k16, v16), (k32, v32) in zip(prompt_part(as_stored.past_key_values), widened):
        assert k16.dtype == torch.bfloat16 and k32.dtype == torch.float32
        assert torch.equal(k16.float(), k32) and torch.equal(v16.float(), v32)
    errors = [rel(a, b) for a, b in zip(run.logits, reference["logits"])]
    assert max(errors) <= LOGIT_RTOL, errors
    negatives = {
        name: teacher_forced_errors(model, reference, make_cache(bad, model.config), PROMPT_LEN - 1)
        for name, bad in layout_mistakes(widened).items()
    }
    for name, bad in negatives.items():
        assert sorted(bad)[STEPS // 2] > 2 * LOGIT_RTOL, (name, bad)
    MEASURED["fp32_teacher_forced_logit_rel"] = [round(e, 3) for e in errors]
    MEASURED["fp32_layout_mistake_logit_rel_median"] = {
        name: round(sorted(bad)[STEPS // 2], 3) for name, bad in negatives.items()
    }
    MEASURED["fp32_free_running_tokens_equal_to_reference"] = _agreeing(
        free.token_ids, reference["tokens"]
    )
    MEASURED["transformers_bf16_vs_fp32_first_step_logit_rel"] = round(
        rel(references[torch.bfloat16]["logits"][0], reference["logits"][0]), 3
    )


def _agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


# ------------------------------------------- (d) a transformers decode worker on another node


def _get_not_found(node) -> float:
    """The node's count of gets that found nothing (``kvfabric_store_errors_total``)."""
    with urllib.request.urlopen(f"{node.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvfabric_store_errors_total{")
        and 'op="get"' in line
        and 'kind="not_found"' in line
    )


def test_transformers_decode_on_another_node_pulls_the_prefill(
    engines, nodes, ns, models, references
) -> None:
    model, reference = models[torch.bfloat16], references[torch.bfloat16]
    keys = [ref.key for ref in chunk_hashes(ns, P)]
    with Client(nodes[DECODE].socket) as client:
        assert client.node_id == DECODE and client.can_pull
        assert client.lookup(ns, keys=keys).matched_chunks == 0  # all on the prefill node
        not_found = _get_not_found(nodes[DECODE])
        started = time.monotonic()
        run = decode_from_fabric(
            client, ns, model, P, STEPS, teacher_tokens=reference["tokens"], return_logits=True
        )
        MEASURED["decode_node_pull_and_decode_s"] = round(time.monotonic() - started, 2)
        assert run.fabric is not None
        assert (run.fabric.pulled, run.fabric.source) == (3, PREFILL)
        # pulled before it was pinned: no get of a chunk the node did not hold yet (the old
        # loader's get-then-pull counted each pulled chunk as a not_found store error)
        assert _get_not_found(nodes[DECODE]) == not_found
        assert run.prefix_tokens == PROMPT_LEN - 1 and run.computed_tokens == 1
        assert client.lookup(ns, keys=keys).matched_chunks == 3  # now held here
        free = decode_from_fabric(client, ns, model, P, STEPS)
        assert free.fabric is not None and free.fabric.pulled == 0
    errors = [rel(a, b) for a, b in zip(run.logits, reference["logits"])]
    assert max(errors) <= LOGIT_RTOL, errors
    for name, bad in layout_mistakes(prompt_part(run.fabric.past_key_values)).items():
        off = teacher_forced_errors(model, reference, make_cache(bad, model.config), PROMPT_LEN - 1)
        assert sorted(off)[STEPS // 2] > 2 * LOGIT_RTOL, (name, off)
    MEASURED["bf16_teacher_forced_logit_rel"] = [round(e, 3) for e in errors]
    MEASURED["bf16_free_running_tokens_equal_to_reference"] = _agreeing(
        free.token_ids, reference["tokens"]
    )
    MEASURED["bf16_free_running_tokens_equal_to_vllm"] = _agreeing(
        free.token_ids, engines.outputs("monolithic-256")[0]["token_ids"]
    )


# ------------------------------------- the loader alone: transformers' own KV, round trip


def test_round_trip_of_transformers_kv_is_exact(start_daemon, ns, models) -> None:
    """KV put in canonical layout comes back bit for bit, and a decode from it is exactly
    a decode from transformers' own cache of the same prefix; a missing chunk ends the
    prefix; a node outside a cluster answers at once (there is nothing to pull from)."""
    model = models[torch.bfloat16]
    tokens = prompt(22, 600)  # two full chunks and a partial one of 88 tokens
    with torch.inference_mode():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    kv = torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    )  # [layer, k|v, head, token, dim]
    refs = chunk_hashes(ns, tokens)
    daemon = start_daemon("store.tiers.dram.capacity=64MiB", "store.tiers.ssd.capacity=256MiB")
    with Client(daemon.socket) as client:
        payloads = [
            kv[:, :, :, i * CHUNK : i * CHUNK + ref.num_tokens].contiguous()
            for i, ref in enumerate(refs)
        ]
        assert client.put_many(ns, refs, payloads) == [True] * 3
        assert not client.can_pull  # outside a cluster: the loader does not ask it to pull
        whole = load_past_key_values(client, ns, tokens, config=model.config)
        assert (whole.num_tokens, whole.chunks, whole.pulled) == (600, 3, 0)
        for got, want in zip(whole.past_key_values.layers, cache.layers):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        run = decode_from_fabric(client, ns, model, tokens, STEPS, return_logits=True)
        with torch.inference_mode():
            prefix = model(torch.tensor([tokens[:-1]]), use_cache=True).past_key_values
        direct = greedy_decode(
            model,
            tokens,
            STEPS,
            past_key_values=prefix,
            prefix_tokens=len(tokens) - 1,
            return_logits=True,
        )
        assert run.prefix_tokens == len(tokens) - 1
        assert run.token_ids == direct.token_ids
        assert all(torch.equal(a, b) for a, b in zip(run.logits, direct.logits))
        assert client.delete(ns, refs[1].key)
        started = time.monotonic()
        gap = load_past_key_values(client, ns, tokens, dtype=torch.float32)
        assert time.monotonic() - started < 5  # no retrying the daemon's "cannot pull"
        assert (gap.num_tokens, gap.chunks, gap.pulled) == (CHUNK, 1, 0)
        assert gap.past_key_values.layers[0].keys.dtype == torch.float32
        assert torch.equal(
            gap.past_key_values.layers[0].keys, cache.layers[0].keys[:, :, :CHUNK].float()
        )
        assert client.stats()["objects"] == 2


def test_an_fp8_namespace_loads_dequantized_within_the_bound(start_daemon, ns, models) -> None:
    """KV stored in fp8 at put time comes back as bf16 past_key_values (the default) within
    fp8's documented bound, and a decode continues from it."""
    model = models[torch.bfloat16]
    tokens = prompt(23, 2 * CHUNK)
    with torch.inference_mode():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    kv = torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    )  # [layer, k|v, head, token, dim]
    fp8_ns = dataclasses.replace(ns, spec=dataclasses.replace(ns.spec, dtype="float8_e4m3"))
    refs = chunk_hashes(fp8_ns, tokens)
    daemon = start_daemon("store.tiers.dram.capacity=64MiB")
    with Client(daemon.socket) as client:
        for i, ref in enumerate(refs):
            with client.reserve(
                fp8_ns, ref.key, parent=ref.parent, num_tokens=ref.num_tokens
            ) as writer:
                for layer in range(fp8_ns.spec.num_layers):
                    write_layer(writer, layer, kv[layer, :, :, i * CHUNK : (i + 1) * CHUNK])
                    writer.commit_layer(layer)
        loaded = load_past_key_values(client, fp8_ns, tokens, config=model.config)
        assert loaded.num_tokens == 2 * CHUNK
        for layer, (got, want) in enumerate(zip(loaded.past_key_values.layers, cache.layers)):
            assert got.keys.dtype == torch.bfloat16
            for i in range(2):
                piece = kv[layer, :, :, i * CHUNK : (i + 1) * CHUNK]
                bound = fp8.error_bound(piece, fp8.compute_scales(piece), torch.bfloat16)
                got_kv = torch.stack([got.keys[0], got.values[0]])
                got_kv = got_kv[:, :, i * CHUNK : (i + 1) * CHUNK]
                assert bool(((got_kv.double() - piece.double()).abs() <= bound).all())
            assert not torch.equal(got.keys, want.keys)  # it really went through fp8
        run = decode_from_fabric(client, fp8_ns, model, tokens, STEPS)
        assert run.prefix_tokens == len(tokens) - 1 and len(run.token_ids) == STEPS
