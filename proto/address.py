"""Where a rank and coordd meet when nobody says: an ipc path in a private runtime directory."""

from __future__ import annotations

import os

DEFAULT_SOCKET_NAME = "coordd.sock"


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/coordd, else /tmp/coordd-<uid>; coordd creates it with mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "coordd")
    return os.path.join("/tmp", f"coordd-{os.getuid()}")


def default_address() -> str:
    """`COORDD_ADDRESS` if set, else ipc://<runtime dir>/coordd.sock."""
    return (
        os.environ.get("COORDD_ADDRESS")
        or f"ipc://{os.path.join(runtime_dir(), DEFAULT_SOCKET_NAME)}"
    )
