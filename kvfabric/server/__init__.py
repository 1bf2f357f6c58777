"""The node daemon: control server (sessions, leases, handlers), HTTP API, lifecycle."""
