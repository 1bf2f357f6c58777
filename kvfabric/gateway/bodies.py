"""OpenAI request bodies as the gateway reads and rewrites them.

The gateway forwards a client's body to the engines unchanged but for what a phase needs:
the prefill request of a P/D pair answers one token and carries the hand-off
(``kv_transfer_params``: kvfabric's own dialect, ``{"kvfabric": {"push_to": node}}`` when
the prefill engine pushes), and the decode request carries the prefill answer's params
verbatim (kvfabric_connectors/vllm/handoff.py reads both). Pure functions, no I/O.
"""

from __future__ import annotations

import copy
from typing import Any

from kvfabric.errors import SpecError
from kvfabric.hashing import as_token_array

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# a request that does not bound its output still has a budget: what a queue slot assumes
DEFAULT_OUTPUT_TOKENS = 256


class BadRequest(ValueError):
    """A body the gateway cannot serve (the message says why; HTTP 400)."""


def prompt_token_ids(body: dict[str, Any], path: str) -> list[int] | None:
    """The prompt's token ids when the body carries them (a completions request with a list
    of ints); None when it must be tokenized (text, or a chat)."""
    if path == CHAT:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("messages must be a non-empty list")
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and _token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:  # one prompt in a batch of one
        body["prompt"] = prompt[0]
        return prompt_token_ids(body, path)
    raise BadRequest("prompt must be one string or one list of token ids")


def tokenize_body(body: dict[str, Any], path: str, model: str) -> dict[str, Any]:
    """What vLLM's ``/tokenize`` needs to count the prompt as the engine will."""
    if path == CHAT:
        out: dict[str, Any] = {"model": model, "messages": body["messages"]}
        out["add_generation_prompt"] = body.get("add_generation_prompt", True)
        for key in ("chat_template", "chat_template_kwargs", "tools"):
            if key in body:
                out[key] = body[key]
        return out
    return {"model": model, "prompt": body["prompt"]}


def max_output_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if not _token(value):
                raise BadRequest(f"{key} must be an integer >= 0")
            return int(value)
    return DEFAULT_OUTPUT_TOKENS


def cache_salt(body: dict[str, Any]) -> str:
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise BadRequest("cache_salt must be a string")
    return salt


def prefill_body(body: dict[str, Any], push_to: str | None) -> dict[str, Any]:
    """The prefill half of a P/D pair: one output token, not streamed, the hand-off asked."""
    out = copy.deepcopy(body)
    for key in ("stream", "stream_options", "max_completion_tokens"):
        out.pop(key, None)
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {"kvfabric": {"push_to": push_to} if push_to else {}}
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode half: the client's request plus the prefill answer's hand-off."""
    out = dict(body)
    if params:
        out["kv_transfer_params"] = params
    return out


def _token_ids(values: list[Any]) -> bool:
    """Whether ``values`` are token ids (int32 ints >= 0), checked in C: kvfabric's packing
    reads a list's ints once (12 us for 2k ids, where numpy's conversion took 94)."""
    if not isinstance(values[0], int) or isinstance(values[0], bool):
        return False
    try:
        array = as_token_array(values)
    except SpecError:  # not all ints (a bool, a float, a list), or past int32
        return False
    return int(array.min()) >= 0


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
