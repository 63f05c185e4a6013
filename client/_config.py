"""One rank's client settings, given once and read by every part of the client."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from coordd.proto.address import default_address
from coordd.proto.defaults import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from coordd.proto.keyfile import KeyFileError, read_key_file

#: Environment variables that name the key files a rank uses when `curve` is not given.
SERVER_KEY_ENV = "COORDD_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "COORDD_CURVE_CLIENT_KEY"


@dataclass(frozen=True)
class CurveKeys:
    """CURVE credentials for tcp: coordd's public key and this rank's key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: str, client_secret_file: str) -> CurveKeys:
        """coordd's public key file (NAME.key) and this rank's secret one (NAME.key_secret)."""
        server_public, _ = read_key_file(server_public_file)
        public, secret = read_key_file(client_secret_file)
        if secret is None:
            raise KeyFileError(
                client_secret_file, "has no secret-key: give the rank's NAME.key_secret file"
            )
        return cls(server_public, public, secret)


def curve_keys_from_env() -> CurveKeys | None:
    """Keys from $COORDD_CURVE_SERVER_KEY and $COORDD_CURVE_CLIENT_KEY, or None if unset."""
    server, client = os.environ.get(SERVER_KEY_ENV), os.environ.get(CLIENT_KEY_ENV)
    if not server and not client:
        return None
    if not server or not client:
        missing = SERVER_KEY_ENV if not server else CLIENT_KEY_ENV
        raise KeyFileError(missing, "is unset: CURVE needs both key files")
    return CurveKeys.from_files(server, client)


#: A client's default wait before coordd has said its step timeout (an older coordd, or the
#: device path), and the least default wait.
DEFAULT_WAIT_TIMEOUT = 60.0
#: How much longer than coordd's step timeout (plus the heartbeat timeout) a default wait is:
#: room for coordd's timer and the StepFailed's way back.
WAIT_MARGIN = 5.0


#: The longest step timeout a Welcome is believed for (coordd's --step-timeout takes at most
#: a day): a wait is never made endless by what a peer says.
MAX_STEP_TIMEOUT = 86_400.0


def default_wait_timeout(step_timeout: float, heartbeat_timeout: float) -> float:
    """A wait that outlives coordd's `step_timeout` (from its Welcome; 0 if not said): at
    least DEFAULT_WAIT_TIMEOUT, else the step timeout (at most a day) + the heartbeat timeout
    + WAIT_MARGIN."""
    if not 0 < step_timeout < math.inf:  # not said (0), or nonsense (NaN, negative, inf)
        return DEFAULT_WAIT_TIMEOUT
    step_timeout = min(step_timeout, MAX_STEP_TIMEOUT)
    return max(DEFAULT_WAIT_TIMEOUT, step_timeout + heartbeat_timeout + WAIT_MARGIN)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """What a rank tells coordd about itself, and how long it waits.

    The device path reads only the group fields (dp_rank .. num_ubatches) and `wait_timeout`;
    `address`, the heartbeats and `curve` concern the connection to coordd."""

    dp_rank: int
    dp_size: int
    #: None: $COORDD_ADDRESS, else the ipc socket in the private runtime directory.
    address: str | None = None
    #: Ranks whose engine configs differ must not form a group: coordd rejects a mismatch.
    config_fingerprint: str = ""
    group: str = "default"
    num_ubatches: int = 2
    #: Tells a restarted rank from its old connection; None: one is made per client.
    incarnation: str | None = None
    #: Default seconds a wait for a decision may take before `StepTimeout`. None: longer than
    #: coordd's --step-timeout (`default_wait_timeout`), so coordd's error naming the late
    #: ranks arrives first.
    wait_timeout: float | None = None
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    #: None: the key files named by the environment, if set (see `curve_keys_from_env`).
    curve: CurveKeys | None = None

    def __post_init__(self) -> None:
        """Times must be finite positive seconds that libzmq's millisecond options hold."""
        for name, high in (
            ("wait_timeout", 31_536_000.0),
            ("heartbeat_interval", 86_400.0),
            ("heartbeat_timeout", 86_400.0),
        ):
            value = getattr(self, name)
            if value is None and name == "wait_timeout":
                continue
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not 0.001 <= value <= high
            ):
                raise ValueError(
                    f"ClientConfig.{name} must be 0.001..{high:g} seconds, got {value!r}"
                )

    @classmethod
    def of(
        cls, config: ClientConfig | None = None, address: str | None = None, **options: Any
    ) -> ClientConfig:
        """`config` with `options` (and `address`, unless None) replacing its fields, or a new
        one from the options alone: how the clients take `config=`, keywords, or both."""
        if address is not None:
            options["address"] = address
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options) if options else config

    def resolved(self) -> ClientConfig:
        """This config with `address` filled in ($COORDD_ADDRESS or the default ipc path)."""
        if self.address is not None:
            return self
        return dataclasses.replace(self, address=default_address())
