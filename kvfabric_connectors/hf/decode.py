"""A plain PyTorch / transformers greedy decode loop that continues from the fabric's KV.

The CPU fallback for long-tail decode: a node without a serving engine (or with a different
accelerator, or a model in another dtype) takes over a request whose prompt a prefill engine
already put into the fabric, and computes only what the fabric does not hold::

    ns = namespace_for(served_model_name, model.config, dtype="bfloat16")
    with Client(socket) as client:
        result = decode_from_fabric(client, ns, model, prompt_ids, max_new_tokens=64)
    result.token_ids          # greedy continuation
    result.prefix_tokens      # prompt tokens whose KV came from the fabric

The last prompt token is always computed here (its logits give the first new token), so the
fabric is asked for at most ``len(prompt) - 1`` tokens, like a vLLM ``kv_consumer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfabric.client import Client
from kvfabric.spec import Namespace

from .past_kv import DEFAULT_TIMEOUT_S, FabricPrefix, load_past_key_values, make_cache


@dataclass
class DecodeResult:
    token_ids: list[int]  # generated, greedy (argmax) at every step
    prefix_tokens: int  # prompt tokens taken from the given cache (not computed here)
    computed_tokens: int  # prompt tokens run through the model here
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, fp32 [vocab]
    past_key_values: Any = None  # the cache after the last step
    fabric: FabricPrefix | None = None  # what decode_from_fabric loaded


@torch.inference_mode()
def greedy_decode(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    past_key_values: Any = None,
    prefix_tokens: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    teacher_tokens: Sequence[int] | None = None,
    return_logits: bool = False,
) -> DecodeResult:
    """Greedy generation with ``model`` (a transformers causal LM), batch 1.

    ``past_key_values`` holds the KV of ``prompt_ids[:prefix_tokens]`` (at positions
    ``0..prefix_tokens-1``); the rest of the prompt is computed in one forward pass, then one
    token per step. Stops after ``max_new_tokens`` or at ``eos_token_id``.
    ``teacher_tokens`` feeds those tokens instead of the argmax (the recorded tokens and
    logits are still the model's own predictions): scores a continuation without letting one
    early difference change every later step.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("an empty prompt has nothing to continue")
    if not 0 <= prefix_tokens < len(prompt):
        raise ValueError(
            f"prefix_tokens={prefix_tokens}: at least the last of the "
            f"{len(prompt)} prompt tokens must be computed"
        )
    if past_key_values is None:
        if prefix_tokens:
            raise ValueError("prefix_tokens without past_key_values")
        past_key_values = make_cache([], model.config)
    if teacher_tokens is not None and len(teacher_tokens) < max_new_tokens - 1:
        raise ValueError(f"{len(teacher_tokens)} teacher tokens for {max_new_tokens} steps")
    cached = past_key_values.get_seq_length()
    if cached != prefix_tokens:
        raise ValueError(f"the cache holds {cached} tokens, prefix_tokens={prefix_tokens}")
    stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device = model.device
    pending = prompt[prefix_tokens:]
    position = prefix_tokens
    tokens: list[int] = []
    logits_out: list[torch.Tensor] = []
    while len(tokens) < max_new_tokens:
        ids = torch.tensor([pending], dtype=torch.long, device=device)
        positions = torch.arange(position, position + len(pending), device=device)
        out = model(
            input_ids=ids,
            past_key_values=past_key_values,
            use_cache=True,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
            logits_to_keep=1,
        )
        past_key_values = out.past_key_values
        last = out.logits[0, -1].float()
        if return_logits:
            logits_out.append(last.cpu())
        token = int(last.argmax())
        tokens.append(token)
        position += len(pending)
        if token in stop:
            break
        pending = [int(teacher_tokens[len(tokens) - 1]) if teacher_tokens is not None else token]
    return DecodeResult(
        tokens, prefix_tokens, len(prompt) - prefix_tokens, logits_out, past_key_values
    )


def decode_from_fabric(
    client: Client,
    ns: Namespace,
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    pull: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    eos_token_id: int | Sequence[int] | None = None,
    teacher_tokens: Sequence[int] | None = None,
    return_logits: bool = False,
) -> DecodeResult:
    """Load the prompt's KV from the fabric (all but the last token at most, converted to
    the model's dtype) and decode greedily from there; a prefix the fabric lacks is
    computed here. See :func:`load_past_key_values` and :func:`greedy_decode`."""
    prompt = [int(t) for t in prompt_ids]
    prefix = load_past_key_values(
        client,
        ns,
        prompt,
        dtype=model.dtype,
        device=model.device,
        config=model.config,
        max_tokens=len(prompt) - 1,
        pull=pull,
        timeout=timeout,
    )
    result = greedy_decode(
        model,
        prompt,
        max_new_tokens,
        past_key_values=prefix.past_key_values,
        prefix_tokens=prefix.num_tokens,
        eos_token_id=eos_token_id,
        teacher_tokens=teacher_tokens,
        return_logits=return_logits,
    )
    result.fabric = prefix
    return result
