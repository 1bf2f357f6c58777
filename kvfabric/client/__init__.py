"""Client library of the node daemon, used by every connector."""

from kvfabric.client.client import Client
from kvfabric.client.objects import RemoteReader, RemoteWriter
from kvfabric.client.tls import ClientTLS

__all__ = ["Client", "ClientTLS", "RemoteReader", "RemoteWriter"]
