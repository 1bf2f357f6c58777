"""``kvfabric gateway``: an OpenAI-compatible front door that places each phase by cost.

The policies are :mod:`kvfabric.sched` (pure); this package is their plane: it observes the
engines and the fabric, queues tenants, carries plans out over HTTP.

* :mod:`.config` -- the YAML file: engines, hardware classes, fabric, link, tenants, deadlines;
* :mod:`.tenancy` -- a request's tenant and priority class (API keys or headers);
* :mod:`.holdings` -- one cluster lookup per request: what each node holds of the prompt;
* :mod:`.engines` -- engines' live state (health, in flight, measured throughput);
* :mod:`.admission` -- the tenants' fair queue in front of the engines' slots;
* :mod:`.bodies` -- OpenAI bodies read and rewritten for a phase (the P/D hand-off);
* :mod:`.dispatch` -- a plan carried out: engine calls, streams, one retry, metrics;
* :mod:`.metrics` -- its Prometheus series; :mod:`.app` -- the FastAPI application.

Everything runs on one event loop (uvicorn's); no state is shared across threads.
"""
