"""The prefill -> decode hand-off in kv_transfer_params: kvfabric's own key and vLLM's P/D
dialect (vllm-router's PD mode, vLLM's example proxies), read and answered."""

from __future__ import annotations

from kvfabric_connectors.vllm.handoff import Handoff, answer, decode_addr, read_params

# what vllm-router 0.1.17 sends as X-Request-Id, as vLLM's completions endpoint keeps it
ROUTER_ID = (
    "cmpl-___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_"
    "0123456789abcdef0123456789abcdef-0-5f3c2a1b"
)
# the nixl template the router puts on every prefill request
NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_the_decode_address_comes_from_the_router_request_id() -> None:
    assert decode_addr(ROUTER_ID) == "127.0.0.1:8200"
    assert decode_addr("cmpl-4f2a-0") is None
    assert decode_addr("___decode_addr_127.0.0.1:8200_not-a-uuid") is None


def test_a_router_prefill_request_asks_for_the_pd_dialect_and_nothing_else() -> None:
    handoff = read_params(NIXL_PREFILL, ROUTER_ID, 700)
    assert handoff == Handoff(expect_tokens=0, push_to=None, remote_decode=True)
    assert answer(handoff, 700) == {
        "kvfabric": {"tokens": 700},
        "do_remote_prefill": True,
        "do_remote_decode": False,
    }
    assert answer(handoff, 0) is None  # nothing stored: the decode computes everything


def test_without_the_pd_dialect_a_producer_answers_only_its_own_key() -> None:
    assert answer(read_params(None, "cmpl-1", 700), 512) == {"kvfabric": {"tokens": 512}}


def test_a_decode_request_expects_what_the_producer_announced() -> None:
    forwarded = {"kvfabric": {"tokens": 512}, "do_remote_prefill": True, "do_remote_decode": False}
    assert read_params(forwarded, ROUTER_ID, 700).expect_tokens == 512
    # a proxy that builds the decode params itself: the whole prompt but its last token
    assert read_params({"do_remote_prefill": True}, "x", 700).expect_tokens == 699
    assert read_params({"kvfabric": {"tokens": 9000}}, "x", 700).expect_tokens == 700
    assert read_params({"do_remote_prefill": False}, "x", 700).expect_tokens == 0


def test_the_push_target_is_the_request_s_then_the_setting_then_the_router_s_decode() -> None:
    targets = {"127.0.0.1:8200": "decode-b"}
    assert read_params(NIXL_PREFILL, ROUTER_ID, 7, push_targets=targets).push_to == "decode-b"
    static = read_params(NIXL_PREFILL, ROUTER_ID, 7, push_to="node-s", push_targets=targets)
    assert static.push_to == "node-s"
    own = {"kvfabric": {"push_to": "node-r"}}
    assert read_params(own, ROUTER_ID, 7, push_to="node-s").push_to == "node-r"
    # an unmapped decode engine, or no router id: no push (the consumer pulls)
    other = {"127.0.0.1:9999": "decode-c"}
    assert read_params(NIXL_PREFILL, ROUTER_ID, 7, push_targets=other).push_to is None
    assert read_params(NIXL_PREFILL, "cmpl-1", 7, push_targets=targets).push_to is None
