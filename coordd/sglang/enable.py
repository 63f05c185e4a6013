"""Whether the plugin is on in this process, and its settings: all from the environment.

SGLang loads general plugins in each scheduler process and passes them nothing, so the
environment is the one channel that reaches every rank. The switches follow the vLLM plugin's
(`coordd.vllm.enable`), named for SGLang; COORDD_ADDRESS is shared, as it names the sidecar.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from coordd.vllm.enable import ADDRESS_ENV, SettingsError, _seconds

#: "1" turns the plugin on (the address then comes from COORDD_ADDRESS or coordd's default
#: ipc path); "0" keeps it off even when COORDD_ADDRESS is set.
ENABLE_ENV = "COORDD_SGLANG"
#: Seconds a group's first sync may wait for coordd's Welcome (default 60).
CONNECT_TIMEOUT_ENV = "COORDD_SGLANG_CONNECT_TIMEOUT"
#: Seconds one sync may wait for its rows (default 120). Keep it above coordd's
#: --step-timeout, so that coordd's StepTimeout naming the late rank arrives first.
SYNC_TIMEOUT_ENV = "COORDD_SGLANG_SYNC_TIMEOUT"

__all__ = [
    "ADDRESS_ENV",
    "CONNECT_TIMEOUT_ENV",
    "ENABLE_ENV",
    "SYNC_TIMEOUT_ENV",
    "PluginSettings",
    "SettingsError",
    "settings_from_env",
]


@dataclass(frozen=True)
class PluginSettings:
    """How this process reaches coordd. `address` None: coordd's default ipc path."""

    address: str | None = None
    connect_timeout: float = 60.0
    sync_timeout: float = 120.0


def settings_from_env(env: Mapping[str, str] | None = None) -> PluginSettings | None:
    """The plugin's settings, or None when it is off (neither COORDD_SGLANG=1 nor
    COORDD_ADDRESS set, or COORDD_SGLANG=0)."""
    env = os.environ if env is None else env
    switch = env.get(ENABLE_ENV, "").strip().lower()
    address = env.get(ADDRESS_ENV, "").strip() or None
    if switch in ("0", "false", "no", "off"):
        return None
    if switch and switch not in ("1", "true", "yes", "on"):
        raise SettingsError(f"{ENABLE_ENV}={switch!r}: use 1 (on) or 0 (off)")
    if not switch and address is None:
        return None
    return PluginSettings(
        address=address,
        connect_timeout=_seconds(env, CONNECT_TIMEOUT_ENV, 60.0),
        sync_timeout=_seconds(env, SYNC_TIMEOUT_ENV, 120.0),
    )
