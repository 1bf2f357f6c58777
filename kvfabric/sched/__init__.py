"""Phase-aware scheduling policies: plain, deterministic code with no I/O.

* :mod:`kvfabric.sched.model` -- the values a decision reads: a request, each engine's
  state, hardware-class profiles, what the fabric holds where.
* :mod:`kvfabric.sched.cost` -- the cost terms of running a phase on an engine (uncached
  prefill, transfer of chunks held elsewhere, queueing, decode), each kept visible.
* :mod:`kvfabric.sched.planner` -- the plan for one request: which engine prefills, which
  decodes, push or pull, or one engine when disaggregation does not pay.
* :mod:`kvfabric.sched.fair_queue` -- weighted fair queueing of tenants by token budget,
  priority classes, admission with a retry-after.

A gateway (or the capacity planner's simulator) feeds them observed state and acts on what
they return; nothing here reads a clock, a socket or a file.
"""
