"""The library engine ranks import: report each step's batch, collect the group's decision."""

from client.aio import AsyncCoordClient
from client.factory import connect_coordinator
from client.sync import CoordClient, PendingStep
from client.transport import CurveKeys

__all__ = ["AsyncCoordClient", "CoordClient", "CurveKeys", "PendingStep", "connect_coordinator"]
