"""``kvfabric doctor``: checks a node for what the daemon needs, and says how to fix what is
wrong.

One module per concern, each a set of checks returning frozen
:class:`~kvfabric.doctor.result.CheckResult` values (name, severity ok / info / warn /
error, message, fix) and never raising for what it finds:

* :mod:`kvfabric.doctor.memory`: /dev/shm, memfd sealing, memory tiers against RAM;
* :mod:`kvfabric.doctor.pages`: reserved and transparent huge pages against the tiers;
* :mod:`kvfabric.doctor.numa`: NUMA nodes against the tiers' ``numa_node``;
* :mod:`kvfabric.doctor.limits`: RLIMIT_NOFILE and RLIMIT_MEMLOCK;
* :mod:`kvfabric.doctor.disk`: the SSD tier against its filesystem, and its speed;
* :mod:`kvfabric.doctor.index`: Redis reachability, latency and clock skew;
* :mod:`kvfabric.doctor.transport`: NIXL / UCX (probed in a child:
  :mod:`kvfabric.doctor.nixl_probe`);
* :mod:`kvfabric.doctor.places`: the socket's directory and path, the ports.

:mod:`kvfabric.doctor.checks` runs them all on a config; :mod:`kvfabric.doctor.report`
prints them; :mod:`kvfabric.doctor.result` maps the worst severity to the exit code (0 ok /
info, 1 warn, 2 error). Where ``kvfabric serve`` checks the same thing
(:mod:`kvfabric.preflight`) the doctor reuses its code and its rule.

This package's ``__init__`` imports nothing: the NIXL probe child starts from it.
"""
