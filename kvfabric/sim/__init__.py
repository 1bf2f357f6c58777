"""A discrete-event simulator of a kvfabric cluster (simpy), scheduled by kvfabric's own
policies (:mod:`kvfabric.sched`).

* :mod:`kvfabric.sim.workload` -- arrivals (Poisson, bursty), length distributions, tenants,
  shared prefixes; drawn up front from a seed;
* :mod:`kvfabric.sim.engine` -- one engine: continuous batching with a step-time model per
  hardware class, hosts whose cores engines share;
* :mod:`kvfabric.sim.fabric` -- the fabric's tiers per node (DRAM, SSD; LRU);
* :mod:`kvfabric.sim.overlap` -- layer-wise streaming of a prefill's KV over a link;
* :mod:`kvfabric.sim.cluster` -- engines, fabric and the gateway's scheduling together;
* :mod:`kvfabric.sim.results` -- per-request times and the summary figures.

No I/O and no clock but the simulated one (``wall_s`` in a result measures the simulator).
"""
