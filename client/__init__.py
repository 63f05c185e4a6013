"""The library engine ranks import: report each step's batch, collect the group's decision."""

from coordd.client.aio import AsyncCoordClient
from coordd.client.config import ClientConfig, CurveKeys
from coordd.client.factory import connect_coordinator
from coordd.client.session import RoundStillOpen
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
