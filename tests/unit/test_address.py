"""Addresses and the ipc path coordd owns (issue 11, C and D): every malformed address is one
sentence with the fix; a second coordd on a path is refused; a socket that is not ours is never
removed; the socket is 0600 whatever the umask; another user's runtime directory or a symlink
there is refused and never chmod'ed."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordd.io._listen import BindError, IpcSocket
from coordd.proto.address import (
    FROM_ARGUMENT,
    FROM_DEFAULT,
    FROM_ENV,
    AddressError,
    check_address,
    resolve_address,
    runtime_dir,
    runtime_dir_problem,
)

ROOT = os.getuid() == 0


@pytest.mark.parametrize(
    ("address", "binding", "says"),
    [
        ("localhost:5555", False, "has no scheme: write tcp://localhost:5555"),
        ("/run/coordd.sock", True, "has no scheme: write ipc:///run/coordd.sock"),
        ("tcp://127.0.0.1", True, "has no port"),
        ("tcp://:5555", True, "has no host"),
        ("tcp://::1:5555", True, "IPv6 host goes in brackets"),
        ("tcp://[::1:5555", True, "closing ']'"),
        ("tcp://127.0.0.1:99999", True, "not a number in 1..65535"),
        ("tcp://127.0.0.1:abc", True, "not a number"),
        ("tcp://*:5555", False, "a client needs coordd's host"),
        ("tcp://127.0.0.1:*", False, "a client needs coordd's port"),
        ("udp://127.0.0.1:5555", True, "not udp://"),
        ("ipc://", True, "names no path"),
        ("ipc:///tmp/" + "a" * 120, True, "longer than a UNIX socket address holds (107)"),
        (" ipc:///tmp/x.sock", True, "spaces"),
        ("", True, "empty"),
    ],
)
def test_a_bad_address_says_what_to_write(address: str, binding: bool, says: str) -> None:
    with pytest.raises(AddressError, match=None) as caught:
        check_address(address, binding=binding)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("address", "binding", "ipv6"),
    [
        ("tcp://[::1]:5555", False, True),
        ("tcp://[::]:*", True, True),
        ("tcp://127.0.0.1:0", True, False),
        ("tcp://*:5555", True, False),
        ("tcp://coordd.example:5555", False, False),
        ("ipc:///run/coordd/coordd.sock", False, False),
        ("ipc://@coordd-abstract", True, False),
    ],
)
def test_good_addresses_pass(address: str, binding: bool, ipv6: bool) -> None:
    assert check_address(address, binding=binding).ipv6 is ipv6


def test_where_an_address_came_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    assert resolve_address(None) == (f"ipc://{tmp_path}/coordd/coordd.sock", FROM_DEFAULT)
    monkeypatch.setenv("COORDD_ADDRESS", "tcp://h:1")
    assert resolve_address(None) == ("tcp://h:1", FROM_ENV)
    assert resolve_address("ipc:///x") == ("ipc:///x", FROM_ARGUMENT)


# -- the ipc path -------------------------------------------------------------------------------


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    yield Path(runtime_dir())


def _bind(address: str) -> tuple[zmq.Socket, IpcSocket]:
    claimed = IpcSocket.claim(address)
    assert claimed is not None
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    claimed.bind(sock)
    return sock, claimed


def test_a_second_claim_on_a_live_path_is_refused_naming_the_owner(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/coordd.sock"
    sock, first = _bind(address)
    try:
        with pytest.raises(BindError, match=rf"another coordd \(pid {os.getpid()}\) serves"):
            IpcSocket.claim(address)
        assert stat.S_ISSOCK(os.lstat(tmp_path / "coordd.sock").st_mode), "still the first's"
    finally:
        sock.close(linger=0)
        first.release()
    assert not (tmp_path / "coordd.sock").exists()
    assert not (tmp_path / "coordd.sock.lock").exists()
    again = IpcSocket.claim(address)  # once released, the path is free again
    assert again is not None
    again.release()


def test_the_socket_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        sock, claimed = _bind(f"ipc://{tmp_path}/coordd.sock")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.lstat(tmp_path / "coordd.sock").st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(tmp_path / "coordd.sock.lock").st_mode) == 0o600
    finally:
        sock.close(linger=0)
        claimed.release()


def test_660_gives_the_group_access(tmp_path: Path) -> None:
    claimed = IpcSocket.claim(f"ipc://{tmp_path}/coordd.sock", 0o660)
    assert claimed is not None
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        claimed.bind(sock)
        assert stat.S_IMODE(os.lstat(tmp_path / "coordd.sock").st_mode) == 0o660
    finally:
        sock.close(linger=0)
        claimed.release()


def test_release_leaves_a_socket_that_is_not_the_one_it_bound(tmp_path: Path) -> None:
    path = tmp_path / "coordd.sock"
    sock, claimed = _bind(f"ipc://{path}")
    sock.close(linger=0)
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))  # someone else's socket now lives at the path
    try:
        claimed.release()
        assert stat.S_ISSOCK(os.lstat(path).st_mode), "another's socket was removed"
    finally:
        other.close()


def test_a_live_listener_without_the_lock_is_not_unlinked(tmp_path: Path) -> None:
    path = tmp_path / "coordd.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    try:
        with pytest.raises(BindError, match="a live process listens"):
            IpcSocket.claim(f"ipc://{path}")
        assert path.exists()
    finally:
        listener.close()


def test_a_stale_socket_is_replaced_but_a_plain_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "coordd.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # nobody listens: a dead coordd's
    claimed = IpcSocket.claim(f"ipc://{path}")
    assert claimed is not None and not path.exists()
    claimed.release()
    path.write_text("data")
    with pytest.raises(BindError, match="is not a socket"):
        IpcSocket.claim(f"ipc://{path}")
    assert path.read_text() == "data"


@pytest.mark.skipif(not ROOT, reason="needs root to make files another uid owns")
def test_another_users_stale_socket_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "coordd.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    os.lchown(path, 54321, 54321)
    with pytest.raises(BindError, match="belongs to uid 54321"):
        IpcSocket.claim(f"ipc://{path}")
    assert path.exists()


def test_a_symlinked_runtime_dir_is_refused_and_its_target_not_chmoded(
    runtime: Path, tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    runtime.symlink_to(target)
    with pytest.raises(BindError, match="symbolic link"):
        IpcSocket.claim(f"ipc://{runtime}/coordd.sock")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755, "the link's target was chmod'ed"
    assert "symbolic link" in (runtime_dir_problem(str(runtime)) or "")


@pytest.mark.skipif(not ROOT, reason="needs root to make a directory another uid owns")
def test_another_users_runtime_dir_is_refused_by_coordd_and_the_client(runtime: Path) -> None:
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    os.chown(runtime, 54321, 54321)
    with pytest.raises(BindError, match="belongs to uid 54321"):
        IpcSocket.claim(f"ipc://{runtime}/coordd.sock")
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o777, "another's directory was chmod'ed"
    from coordd.client.sync import CoordClient
    from coordd.proto import CoordinatorUnavailable

    with pytest.raises(CoordinatorUnavailable, match="belongs to uid 54321"):
        CoordClient(dp_rank=0, dp_size=2)  # the default address: in that directory


def test_a_runtime_dir_is_made_0700_and_a_loosened_one_tightened(runtime: Path) -> None:
    old = os.umask(0)
    try:
        claimed = IpcSocket.claim(f"ipc://{runtime}/coordd.sock")
    finally:
        os.umask(old)
    assert claimed is not None
    claimed.release()
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    os.chmod(runtime, 0o755)
    claimed = IpcSocket.claim(f"ipc://{runtime}/coordd.sock")
    assert claimed is not None
    claimed.release()
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: f"ipc://{d}/file/coordd.sock", "is not a directory"),
        (lambda d: "ipc:///proc/1/coordd.sock", "cannot create files in /proc/1"),
        (lambda d: "ipc:///proc/nosuchdir/x/coordd.sock", "does not exist: create it first"),
        (lambda d: f"ipc://{d}/no/such/dir/coordd.sock", "does not exist: create it first"),
    ],
)
def test_an_unusable_ipc_directory_is_one_sentence(tmp_path: Path, make, says: str) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file").write_text("")
    with pytest.raises(BindError, match=None) as caught:
        IpcSocket.claim(make(tmp_path))
    assert says in str(caught.value) and str(caught.value).startswith("--bind ")
    assert not (tmp_path / "no").exists(), "a mistyped path became directories"
