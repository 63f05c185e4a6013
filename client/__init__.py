"""The library engine ranks import: report each step's batch, collect the group's decision."""

from typing import TYPE_CHECKING

from coordd.client._config import ClientConfig, CurveKeys
from coordd.client._factory import connect_coordinator
from coordd.client._session import RoundStillOpen
from coordd.client.aio import AsyncCoordClient
from coordd.client.sync import CoordClient, PendingGather, PendingStep

if TYPE_CHECKING:
    from coordd.client.fallback import FallbackClient


def __getattr__(name: str) -> object:
    """`FallbackClient` on first use: it imports torch, which a rank on coordd alone lacks."""
    if name == "FallbackClient":
        from coordd.client.fallback import FallbackClient

        return FallbackClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AsyncCoordClient",
    "ClientConfig",
    "CoordClient",
    "CurveKeys",
    "FallbackClient",
    "PendingGather",
    "PendingStep",
    "RoundStillOpen",
    "connect_coordinator",
]
