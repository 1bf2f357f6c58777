"""Capacity planning: what a cluster needs, from measured costs and a workload."""
