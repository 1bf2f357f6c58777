"""The prefill -> decode hand-off in ``kv_transfer_params``: what a request's params ask of
this engine, and what a producer answers.

Two dialects arrive, and both must work with no kvfabric-specific proxy:

* kvfabric's own key, ``{"kvfabric": {"tokens": n, "push_to": node}}``: ``tokens`` is what a
  producer announced (the consumer waits for it), ``push_to`` asks the producer to push;
* vLLM's P/D convention, which vllm-router's PD mode (``--kv-connector nixl``, its default)
  and vLLM's example proxies speak: the prefill request carries ``do_remote_decode: true``
  (and NIXL's ``remote_*`` fields, all null, which kvfabric ignores), and the decode request
  carries the prefill response's params verbatim. A producer asked ``do_remote_decode``
  therefore answers ``do_remote_prefill: true`` next to its own key, as NIXL does; vLLM then
  adds the prefill side's ``remote_prefill_cached_tokens``, and the decode side reports those
  as the request's cached tokens (vLLM's P/D accounting; the decode engine's own hit shows in
  its ``vllm:prompt_tokens_cached`` metric). A consumer given ``do_remote_prefill`` without
  the kvfabric key (a proxy that builds the decode params itself) expects the whole prompt
  but its last token.

The push target: the request's ``push_to``, else the static ``push_to`` setting (one decode
node), else the decode engine the router named in the request id. vllm-router's PD mode (and
vLLM's P2P proxies) send ``X-Request-Id: ___prefill_addr_<P>___decode_addr_<D>_<uuid>``,
which vLLM keeps in the engine's request id; ``push_targets`` maps such a ``host:port`` to
the node id of the daemon beside that decode engine. No match: no push, the consumer pulls.
Pure functions of their arguments; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "kvfabric"
# the router's request id: ___prefill_addr_<host:port>___decode_addr_<host:port>_<uuid hex>
_DECODE_ADDR = re.compile(r"___decode_addr_(.+?)_[0-9a-f]{32}")


@dataclass(frozen=True)
class Handoff:
    """What a request's ``kv_transfer_params`` ask of this engine."""

    expect_tokens: int = 0  # prompt tokens a producer put in the fabric for this request
    push_to: str | None = None  # the node the producer pushes this request's chunks to
    remote_decode: bool = False  # vLLM's P/D dialect: answer with ``do_remote_prefill``


def decode_addr(request_id: str) -> str | None:
    """The decode engine's ``host:port`` named in a router's request id, if any."""
    match = _DECODE_ADDR.search(request_id)
    return match.group(1) if match else None


def read_params(
    params: Mapping[str, Any] | None,
    request_id: str,
    prompt_tokens: int,
    *,
    push_to: str | None = None,
    push_targets: Mapping[str, str] | None = None,
) -> Handoff:
    """The hand-off a request asks for; ``push_to`` / ``push_targets`` are the settings."""
    params = params or {}
    own = params.get(PARAMS_KEY) or {}
    if "tokens" in own:
        expect = int(own["tokens"])
    elif params.get("do_remote_prefill"):
        expect = prompt_tokens - 1  # the last token is computed here anyway
    else:
        expect = 0
    target = own.get("push_to") or push_to
    if target is None and push_targets:
        address = decode_addr(request_id)
        target = push_targets.get(address) if address else None
    return Handoff(
        expect_tokens=max(0, min(expect, prompt_tokens)),
        push_to=target,
        remote_decode=bool(params.get("do_remote_decode")),
    )


def answer(handoff: Handoff, stored_tokens: int) -> dict[str, Any] | None:
    """A producer's params for the decode request: None when the fabric holds nothing of the
    prompt (no consumer must wait for KV that was never stored)."""
    if not stored_tokens:
        return None
    params: dict[str, Any] = {PARAMS_KEY: {"tokens": stored_tokens}}
    if handoff.remote_decode:
        params.update(do_remote_prefill=True, do_remote_decode=False)
    return params
