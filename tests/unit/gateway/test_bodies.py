"""What the gateway reads from an OpenAI body and what each phase of a P/D pair is sent."""

from __future__ import annotations

import pytest

from kvfabric.gateway.bodies import (
    CHAT,
    COMPLETIONS,
    DEFAULT_OUTPUT_TOKENS,
    BadRequest,
    decode_body,
    max_output_tokens,
    prefill_body,
    prompt_token_ids,
)


def test_token_id_prompts_are_read_and_text_or_chat_must_be_tokenized() -> None:
    assert prompt_token_ids({"prompt": [5, 6, 7]}, COMPLETIONS) == [5, 6, 7]
    assert prompt_token_ids({"prompt": [[5, 6]]}, COMPLETIONS) == [5, 6]  # a batch of one
    assert prompt_token_ids({"prompt": "hi"}, COMPLETIONS) is None
    assert prompt_token_ids({"messages": [{"role": "user", "content": "hi"}]}, CHAT) is None


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"prompt": ["a", "b"]}, COMPLETIONS),  # a batch: one plan per request
        ({"prompt": [1, -2]}, COMPLETIONS),
        ({"prompt": [1, 2.5]}, COMPLETIONS),
        ({"prompt": [1, "2"]}, COMPLETIONS),
        ({"prompt": [1, 2**70]}, COMPLETIONS),
        ({"prompt": [1, 2**31]}, COMPLETIONS),  # past int32: no vocabulary is that large
        ({"prompt": [1, True]}, COMPLETIONS),
        ({"prompt": [1, [2]]}, COMPLETIONS),
        ({}, COMPLETIONS),
        ({"messages": []}, CHAT),
    ],
)
def test_prompts_the_gateway_cannot_plan_are_refused(body: dict, path: str) -> None:
    with pytest.raises(BadRequest):
        prompt_token_ids(body, path)


def test_the_output_budget_is_the_request_s_bound_or_the_default() -> None:
    assert max_output_tokens({"max_tokens": 7}) == 7
    assert max_output_tokens({"max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert max_output_tokens({}) == DEFAULT_OUTPUT_TOKENS
    with pytest.raises(BadRequest):
        max_output_tokens({"max_tokens": "many"})


def test_the_prefill_half_answers_one_token_unstreamed_and_asks_the_hand_off() -> None:
    body = {"prompt": [1], "max_tokens": 50, "stream": True, "stream_options": {}, "n": 1}
    pushed = prefill_body(body, "decode-node")
    assert pushed["max_tokens"] == 1 and "stream" not in pushed and "stream_options" not in pushed
    assert pushed["kv_transfer_params"] == {"kvfabric": {"push_to": "decode-node"}}
    assert prefill_body(body, None)["kv_transfer_params"] == {"kvfabric": {}}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is untouched


def test_the_decode_half_is_the_client_s_body_plus_the_prefill_answer_s_params() -> None:
    body = {"prompt": [1], "max_tokens": 50, "stream": True}
    params = {"kvfabric": {"tokens": 256}}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert decode_body(body, None) == body  # nothing stored: the decode engine computes it
