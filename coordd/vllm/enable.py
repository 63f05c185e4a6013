"""Whether the plugin is on in this process, and its settings: all from the environment.

vLLM loads general plugins in every process it starts (front-end, engine cores, workers) and
passes them nothing, so the environment is the one channel that reaches all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: "1" turns the plugin on (the address then comes from COORDD_ADDRESS or coordd's default
#: ipc path); "0" keeps it off even when COORDD_ADDRESS is set.
ENABLE_ENV = "COORDD_VLLM"
#: Where coordd listens (ipc://PATH or tcp://HOST:PORT); setting it turns the plugin on.
ADDRESS_ENV = "COORDD_ADDRESS"
#: Seconds a group's first sync may wait for coordd's Welcome (default 60).
CONNECT_TIMEOUT_ENV = "COORDD_VLLM_CONNECT_TIMEOUT"
#: Seconds one sync may wait for its gathered rows (default 120). Keep it above coordd's
#: --step-timeout, so that coordd's StepTimeout naming the late rank arrives first.
SYNC_TIMEOUT_ENV = "COORDD_VLLM_SYNC_TIMEOUT"

#: "1": the V1 runner's sync starts its round before `_prepare_inputs` and collects it at the
#: sync (coordd.vllm.early). Off by default: on the CPU engine it did not pay (docs/vllm.md).
OVERLAP_ENV = "COORDD_VLLM_OVERLAP"
#: "0" keeps the fail-stop: coordd's loss raises in vLLM's step. On by default: a group that
#: loses coordd goes on with vLLM's own collective and returns when coordd is back
#: (coordd.vllm.fallback).
FALLBACK_ENV = "COORDD_VLLM_FALLBACK"
#: A directory: each process appends its per-step sync timings there (coordd.vllm.timings).
TIMINGS_ENV = "COORDD_VLLM_TIMINGS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """An environment variable of the plugin holds a value it cannot use."""


@dataclass(frozen=True)
class PluginSettings:
    """How this process reaches coordd. `address` None: coordd's default ipc path."""

    address: str | None = None
    connect_timeout: float = 60.0
    sync_timeout: float = 120.0
    #: Start the V1 runner's sync round early (COORDD_VLLM_OVERLAP, default off).
    overlap: bool = False
    #: Go on with vLLM's own collective while coordd is away (COORDD_VLLM_FALLBACK, default
    #: on; off: coordd's loss raises in vLLM's step, as before).
    fallback: bool = True


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise SettingsError(f"{name}={text!r} must be > 0 seconds")
    return value


def settings_from_env(env: Mapping[str, str] | None = None) -> PluginSettings | None:
    """The plugin's settings, or None when it is off (neither COORDD_VLLM=1 nor
    COORDD_ADDRESS set, or COORDD_VLLM=0)."""
    env = os.environ if env is None else env
    switch = env.get(ENABLE_ENV, "").strip().lower()
    address = env.get(ADDRESS_ENV, "").strip() or None
    if switch in _FALSE and switch:
        return None
    if switch and switch not in _TRUE:
        raise SettingsError(f"{ENABLE_ENV}={switch!r}: use 1 (on) or 0 (off)")
    if switch not in _TRUE and address is None:
        return None
    return PluginSettings(
        address=address,
        connect_timeout=_seconds(env, CONNECT_TIMEOUT_ENV, 60.0),
        sync_timeout=_seconds(env, SYNC_TIMEOUT_ENV, 120.0),
        overlap=_switch(env, OVERLAP_ENV, False),
        fallback=_switch(env, FALLBACK_ENV, True),
    )


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(f"{name}={text!r}: use 1 (on) or 0 (off)")
