"""Phase-aware scheduling policies: plain, deterministic code with no I/O.

* :mod:`kvfabric.sched.model` -- the values a decision reads: a request, each engine's
  state, hardware-class profiles, what the fabric holds where.
* :mod:`kvfabric.sched.planner` -- the plan for one request: which engine prefills, which
  decodes, push or pull, or one engine when disaggregation does not pay, with the cost terms
  of the choice (uncached prefill, transfer of chunks held elsewhere, queueing, decode).
* :mod:`kvfabric.sched.throughput` -- engines' measured prefill and decode rates, refining
  their hardware class's configured prior.
* :mod:`kvfabric.sched.fair_queue` -- weighted fair queueing of tenants by token budget,
  priority classes, admission with a retry-after.

A gateway (or the capacity planner's simulator) feeds them observed state and acts on what
they return; nothing here reads a clock, a socket or a file.
"""
