"""A network namespace joined to this one by a veth pair, so one rank can be cut off for real.

coordd listens on the host end's address; the other ranks reach it there from this namespace,
the cut-off rank from inside the namespace over the veth. Taking the namespace's end down drops
that rank's packets silently (no FIN, no RST), as a pulled cable or a partition does; only
heartbeats can tell. Needs root and `ip`; `unavailable()` says why not when it cannot be done.
Every namespace made here is named `coordd-chaos-<pid>-<n>`, and `remove_stale()` deletes those
whose creator is gone.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import threading

PREFIX = "coordd-chaos-"
_counter = itertools.count()
_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


_probed: list[str | None] = []


def unavailable() -> str | None:
    """None if namespaces can be made here, else the reason they cannot (probed once)."""
    with _lock:
        if not _probed:
            _probed.append(_probe())
        return _probed[0]


def _probe() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def remove_stale() -> None:
    """Delete namespaces (and their veths) left by chaos runs whose process is gone."""
    for name in namespaces():
        match = re.match(rf"{PREFIX}(\d+)-", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name, check=False)


class CutNamespace:
    """One namespace + veth pair; `prefix_argv` runs a command inside; `cut`/`restore` it."""

    def __init__(self) -> None:
        with _lock:
            n = next(_counter)
        pid = os.getpid()
        self.name = f"{PREFIX}{pid}-{n}"
        tag = f"{pid % 100000}{n % 100}"
        self.host_if = f"cch{tag}"
        self.ns_if = f"ccn{tag}"
        # 10.<pid-derived>.<n>.0/30: host end .1, namespace end .2
        octet2 = 64 + pid % 128
        octet3 = (n * 4) % 256
        self.host_ip = f"10.{octet2}.{octet3}.1"
        self.ns_ip = f"10.{octet2}.{octet3}.2"
        self.created = False

    def create(self) -> CutNamespace:
        _ip("netns", "add", self.name)
        self.created = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.name)
        _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        self._in_ns("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        self._in_ns("link", "set", self.ns_if, "up")
        self._in_ns("link", "set", "lo", "up")
        return self

    def prefix_argv(self) -> list[str]:
        """Put this before a command line to run it inside the namespace (same pid: exec)."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        self._in_ns("link", "set", self.ns_if, "down")

    def restore(self) -> None:
        self._in_ns("link", "set", self.ns_if, "up")

    def remove(self) -> None:
        if not self.created:
            return
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.name, check=False)
        self.created = False

    def _in_ns(self, *args: str) -> None:
        _ip("netns", "exec", self.name, "ip", *args)
