"""One way to choose the path: coordd (default) or the device path, behind the same methods.

Engine code builds its client here and then calls `connect`, `start`/`wait` and `close` the
same way on either; only this choice knows that torch exists (imported on the device path).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from coordd.client._config import ClientConfig
from coordd.proto.messages import StepDecision, StepKind, StepReport, Welcome

if TYPE_CHECKING:
    from coordd.client.device import DeviceCoordClient
    from coordd.client.fallback import FallbackClient
    from coordd.client.sync import CoordClient

#: Set to 1 (or true/yes/on) to choose the device path when the caller does not say.
DEVICE_PATH_ENV = "COORDD_DEVICE_PATH"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class PendingDecision(Protocol):
    """What `start()` returns on either path."""

    seq: int

    def wait(self, timeout: float | None = None) -> StepDecision: ...

    def done(self) -> bool: ...


class StepClient(Protocol):
    """The methods engine code calls, the same on both paths."""

    def connect(self, timeout: float = 5.0) -> Welcome: ...

    def start(self, report: StepReport, kind: StepKind | str = ...) -> PendingDecision: ...

    def coordinate(
        self, report: StepReport, kind: StepKind | str = ..., timeout: float | None = None
    ) -> StepDecision: ...

    def close(self) -> None: ...


def device_path_enabled(device_path: bool | None = None) -> bool:
    """`device_path` if given, else `COORDD_DEVICE_PATH`; a value that is not a boolean raises."""
    if device_path is not None:
        return device_path
    raw = os.environ.get(DEVICE_PATH_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{DEVICE_PATH_ENV}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def connect_coordinator(
    address: str | None = None,
    *,
    config: ClientConfig | None = None,
    device_path: bool | None = None,
    fallback: bool = False,
    process_group: Any = None,
    device: Any = None,
    context: Any = None,
    **options: Any,
) -> CoordClient | DeviceCoordClient | FallbackClient:
    """A `CoordClient` for coordd at `address`, or a `DeviceCoordClient` on the device path,
    or with `fallback=True` a `FallbackClient`: coordd while it is there, the device path
    over `process_group` while it is not.

    The settings are a `ClientConfig` (`config=`), its fields as keywords, or both, as for
    either client. The device path is chosen by `device_path=True`, or by
    `COORDD_DEVICE_PATH=1` when `device_path` is None. It runs over `process_group` (None:
    torch's default group) on `device`, and ignores what only concerns coordd (the address,
    heartbeats, curve, context), so the caller can pass the same arguments either way. The
    client is not yet registered: call `connect()` next, as with either client.
    """
    config = ClientConfig.of(config, address=address, **options)
    if fallback:
        from coordd.client.fallback import FallbackClient

        return FallbackClient(
            config=config, process_group=process_group, device=device, context=context
        )
    if device_path_enabled(device_path):
        from coordd.client.device import DeviceCoordClient

        return DeviceCoordClient(config=config, process_group=process_group, device=device)
    from coordd.client.sync import CoordClient

    return CoordClient(config=config, context=context)


if TYPE_CHECKING:

    def _both_are_step_clients(
        coordd: CoordClient, device: DeviceCoordClient, fallback: FallbackClient
    ) -> tuple[StepClient, StepClient, StepClient]:
        """mypy checks here that each client has the surface engine code relies on."""
        return coordd, device, fallback
