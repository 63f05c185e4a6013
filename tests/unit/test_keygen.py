"""`coordd keygen`: a key pair is written whole or not at all, never through a planted link."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from coordd.cli.keygen import run
from coordd.io._curve import write_keypair
from coordd.proto.keyfile import KeyFileError, read_key_file


def _pair_matches(directory: Path, name: str) -> bool:
    public, _ = read_key_file(str(directory / f"{name}.key"))
    public_of_secret, secret = read_key_file(str(directory / f"{name}.key_secret"))
    return secret is not None and public == public_of_secret


def test_a_new_pair_matches_and_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        public_path, secret_path = write_keypair(str(tmp_path), "rank0")
    finally:
        os.umask(old)
    assert _pair_matches(tmp_path, "rank0")
    for path in (public_path, secret_path):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.key", "rank0.key_secret"]


def test_an_existing_public_key_alone_leaves_no_mismatched_pair(tmp_path: Path) -> None:
    write_keypair(str(tmp_path), "rank0")
    (tmp_path / "rank0.key_secret").unlink()
    before = (tmp_path / "rank0.key").read_bytes()
    with pytest.raises(KeyFileError, match=r"rank0\.key.*exists"):
        write_keypair(str(tmp_path), "rank0")
    assert (tmp_path / "rank0.key").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.key"], "a stray file was left"


def test_an_existing_secret_alone_is_kept_too(tmp_path: Path) -> None:
    write_keypair(str(tmp_path), "rank0")
    (tmp_path / "rank0.key").unlink()
    before = (tmp_path / "rank0.key_secret").read_bytes()
    with pytest.raises(KeyFileError, match="exists"):
        write_keypair(str(tmp_path), "rank0")
    assert (tmp_path / "rank0.key_secret").read_bytes() == before
    assert not (tmp_path / "rank0.key").exists()


def test_force_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours\n")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "rank0.key_secret").symlink_to(victim)
    (keys / "rank0.key").symlink_to(victim)
    write_keypair(str(keys), "rank0", force=True)
    assert victim.read_text() == "not yours\n"
    for name in ("rank0.key", "rank0.key_secret"):
        mode = os.lstat(keys / name).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600, name
    assert _pair_matches(keys, "rank0")


def test_force_replaces_both_files_of_an_old_pair(tmp_path: Path) -> None:
    write_keypair(str(tmp_path), "rank0")
    old_public, _ = read_key_file(str(tmp_path / "rank0.key"))
    write_keypair(str(tmp_path), "rank0", force=True)
    new_public, _ = read_key_file(str(tmp_path / "rank0.key"))
    assert new_public != old_public and _pair_matches(tmp_path, "rank0")


def test_keygen_prints_the_public_key_and_labels_the_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(argparse.Namespace(names=["coordd"], dir=str(tmp_path), force=False)) == 0
    out = capsys.readouterr().out
    public, _ = read_key_file(str(tmp_path / "coordd.key"))
    assert f"public key {public.decode()}" in out
    secret_line = next(line for line in out.splitlines() if "coordd.key_secret" in line)
    assert "SECRET" in secret_line and public.decode() not in secret_line
    assert run(argparse.Namespace(names=["coordd"], dir=str(tmp_path), force=False)) == 1
