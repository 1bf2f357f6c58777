"""Client library of the node daemon, used by every connector (sync and asyncio)."""

from kvfabric.client.async_client import AsyncClient
from kvfabric.client.client import Client
from kvfabric.client.objects import AsyncRemoteReader, AsyncRemoteWriter, RemoteReader, RemoteWriter
from kvfabric.client.tls import ClientTLS

__all__ = [
    "AsyncClient",
    "AsyncRemoteReader",
    "AsyncRemoteWriter",
    "Client",
    "ClientTLS",
    "RemoteReader",
    "RemoteWriter",
]
