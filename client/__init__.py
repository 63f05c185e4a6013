"""The library engine ranks import: report each step's batch, collect the group's decision."""

from coordd.client._config import ClientConfig, CurveKeys
from coordd.client._factory import connect_coordinator
from coordd.client._session import RoundStillOpen
from coordd.client.aio import AsyncCoordClient
from coordd.client.sync import CoordClient, PendingGather, PendingStep

__all__ = [
    "AsyncCoordClient",
    "ClientConfig",
    "CoordClient",
    "CurveKeys",
    "PendingGather",
    "PendingStep",
    "RoundStillOpen",
    "connect_coordinator",
]
