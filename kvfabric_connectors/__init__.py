"""Engine plugins for kvfabric (import package ``kvfabric_connectors``).

Each plugin talks to its node's daemon through :mod:`kvfabric.client` only, and converts
the engine's KV layout to kvfabric's canonical one at its edge.
"""
