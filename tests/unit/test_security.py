"""CURVE key files, the bind/CURVE option checks, and the private ipc runtime directory."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import zmq.auth

from coordd import cli
from coordd.client._config import CLIENT_KEY_ENV, SERVER_KEY_ENV, CurveKeys, curve_keys_from_env
from coordd.io._curve import (
    SecurityConfigError,
    check_security_options,
    load_client_keys,
    load_secret_key,
    write_keypair,
)
from coordd.io._listen import BindError
from coordd.io._router import prepare_ipc_path
from coordd.proto.address import default_address, runtime_dir
from coordd.proto.keyfile import KeyFileError, is_z85, parse_key_text, read_key_file


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keygen_writes_private_files_that_zmq_reads(tmp_path: Path) -> None:
    old = os.umask(0)  # the files must be 0600 whatever the umask
    try:
        public_path, secret_path = write_keypair(str(tmp_path / "keys"), "coordd")
    finally:
        os.umask(old)
    assert mode(public_path) == mode(secret_path) == 0o600
    assert mode(tmp_path / "keys") == 0o700
    public, secret = read_key_file(secret_path)
    assert read_key_file(public_path) == (public, None)
    assert zmq.auth.load_certificate(secret_path) == (public, secret)  # ZeroMQ's own format
    assert zmq.curve_public(secret) == public, "the pair belongs together"


def test_keygen_never_overwrites_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    assert cli.main(["keygen", "--dir", str(tmp_path), "coordd", "rank"]) == 0
    first = read_key_file(str(tmp_path / "rank.key_secret"))
    assert cli.main(["keygen", "--dir", str(tmp_path), "rank"]) == 1
    assert "exists (pass --force" in capsys.readouterr().err
    assert read_key_file(str(tmp_path / "rank.key_secret")) == first
    assert cli.main(["keygen", "--dir", str(tmp_path), "--force", "rank"]) == 0
    assert read_key_file(str(tmp_path / "rank.key_secret")) != first
    with pytest.raises(ValueError, match="plain file name"):
        write_keypair(str(tmp_path), "../evil")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "No such file"),
        ("metadata\ncurve\n", "no public-key line"),
        ('curve\n    public-key = "short"\n', "must be 40 z85 characters, got 5"),
        ('curve\n    public-key = "' + "~" * 40 + '"\n', "is not valid z85"),
    ],
)
def test_bad_key_files_name_the_file_and_the_problem(tmp_path: Path, content: str | None,
                                                     problem: str) -> None:
    path = tmp_path / "bad.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KeyFileError, match=problem) as info:
        read_key_file(str(path))
    assert info.value.path == str(path)


def test_key_text_parses_without_a_file_and_z85_agrees_with_zeromq() -> None:
    from zmq.utils import z85

    public, secret = zmq.curve_keypair()
    text = b'metadata\ncurve\n    public-key = "%s"\n    secret-key = "%s"\n' % (public, secret)
    assert parse_key_text("mem", text) == (public, secret)
    for sample in (public, secret, b"0" * 40, b"#" * 5, b"%nSc0", b"%nSc1", b"abc", b"~~~~~"):
        try:
            z85.decode(sample)
            valid = True
        except Exception:
            valid = False
        assert is_z85(sample) is valid, sample


def test_secret_and_client_key_loading(tmp_path: Path) -> None:
    write_keypair(str(tmp_path / "server"), "coordd")
    for name in ("a", "b"):
        write_keypair(str(tmp_path / "ranks"), name)
    public, _ = load_secret_key(str(tmp_path / "server" / "coordd.key_secret"))
    with pytest.raises(KeyFileError, match="no secret-key"):
        load_secret_key(str(tmp_path / "server" / "coordd.key"))
    from_dir = load_client_keys([str(tmp_path / "ranks")])  # reads *.key, not *.key_secret
    assert sorted(os.path.basename(f) for f in from_dir.values()) == ["a.key", "b.key"]
    one = load_client_keys([str(tmp_path / "ranks" / "a.key")])
    assert list(one) == [read_key_file(str(tmp_path / "ranks" / "a.key"))[0]]
    assert public not in from_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyFileError, match=r"no \*\.key file"):
        load_client_keys([str(tmp_path / "empty")])


def test_client_keys_from_files_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_keypair(str(tmp_path), "coordd")
    write_keypair(str(tmp_path), "rank")
    keys = CurveKeys.from_files(str(tmp_path / "coordd.key"), str(tmp_path / "rank.key_secret"))
    assert keys.server_public == read_key_file(str(tmp_path / "coordd.key"))[0]
    assert (keys.public, keys.secret) == read_key_file(str(tmp_path / "rank.key_secret"))
    with pytest.raises(KeyFileError, match="no secret-key"):
        CurveKeys.from_files(str(tmp_path / "coordd.key"), str(tmp_path / "rank.key"))
    monkeypatch.delenv(SERVER_KEY_ENV, raising=False)
    monkeypatch.delenv(CLIENT_KEY_ENV, raising=False)
    assert curve_keys_from_env() is None
    monkeypatch.setenv(SERVER_KEY_ENV, str(tmp_path / "coordd.key"))
    with pytest.raises(KeyFileError, match=f"{CLIENT_KEY_ENV}.*unset"):
        curve_keys_from_env()
    monkeypatch.setenv(CLIENT_KEY_ENV, str(tmp_path / "rank.key_secret"))
    assert curve_keys_from_env() == keys


@pytest.mark.parametrize(
    ("bind", "secret", "clients", "insecure", "outcome"),
    [
        ("ipc:///tmp/x.sock", None, [], False, False),
        ("tcp://127.0.0.1:5555", "s.key_secret", ["c.key"], False, True),
        ("tcp://127.0.0.1:5555", None, [], True, False),
        ("tcp://127.0.0.1:5555", None, [], False, "needs CURVE"),
        ("tcp://0.0.0.0:5555", "s.key_secret", [], False, "admits only the client"),
        ("tcp://0.0.0.0:5555", None, ["c.key"], False, "needs --curve-secret-key"),
        ("tcp://0.0.0.0:5555", "s.key_secret", ["c.key"], True, "contradicts"),
        ("ipc:///tmp/x.sock", "s.key_secret", ["c.key"], False, True),
    ],
)
def test_bind_and_curve_options(bind: str, secret: str | None, clients: list[str],
                                insecure: bool, outcome: bool | str) -> None:
    if isinstance(outcome, str):
        with pytest.raises(SecurityConfigError, match=outcome):
            check_security_options(bind, secret, clients, insecure)
    else:
        assert check_security_options(bind, secret, clients, insecure) is outcome


def test_the_default_bind_is_ipc_in_a_private_runtime_dir(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    address = default_address()
    assert address == f"ipc://{tmp_path}/coordd/coordd.sock"
    old = os.umask(0)
    try:
        claimed = prepare_ipc_path(address)
    finally:
        os.umask(old)
    assert claimed is not None and claimed.path == f"{tmp_path}/coordd/coordd.sock"
    claimed.release()
    assert mode(runtime_dir()) == 0o700
    os.chmod(runtime_dir(), 0o755)  # loosened by someone: made private again
    claimed = prepare_ipc_path(address)
    assert claimed is not None
    claimed.release()
    assert mode(runtime_dir()) == 0o700


def test_an_operators_existing_directory_is_left_as_it_is(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "elsewhere"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o770)  # a pod's emptyDir, shared on purpose
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(shared / "coordd.sock"))  # a socket nobody listens on: a dead coordd's
    stale.close()
    claimed = prepare_ipc_path(f"ipc://{shared}/coordd.sock")
    assert claimed is not None and claimed.path == f"{shared}/coordd.sock"
    claimed.release()
    assert mode(shared) == 0o770
    assert not (shared / "coordd.sock").exists(), "a stale socket file is removed"
    assert prepare_ipc_path("tcp://127.0.0.1:5555") is None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another uid owns")
def test_a_runtime_dir_owned_by_another_user_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    os.makedirs(runtime_dir(), mode=0o700)
    os.chown(runtime_dir(), 54321, 54321)
    with pytest.raises(BindError, match="belongs to uid 54321"):
        prepare_ipc_path(default_address())
