"""`coordd status` as an operator reads it (issue 39, item 6): a rank's row keeps what it did
after it left, a stopped group's ranks read `left`, and with nothing running it says, a line per
place asked, what it found there, with exit codes docs/operations.md states."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from coordd.cli.status import render, run
from coordd.ops.endpoints import HttpEndpoints
from coordd.ops.status_doc import status_document
from coordd.proto.coordinator import OnRankLoss
from coordd.proto.messages import Goodbye
from tests.unit.test_observability import peer, registered


def _leave(d: Any, rank: int, at: float) -> None:
    g = d.group()
    d._after(g.coordinator.receive(peer(rank), Goodbye(text="rank closed"), at), g)
    snap = g.coordinator.snapshot()
    if snap.stops != g.observer.stops_seen:  # as the server does after a drain
        g.observer.group_stopped(snap)


def _rows(d: Any) -> list[tuple[str, int, int]]:
    doc = json.loads(json.dumps(status_document(d)))
    return [(r["state"], r["rounds"], r["straggler_rounds"]) for r in doc["groups"][0]["ranks"]]


def _decide(d: Any, ranks: tuple[int, ...], seqs: range, start: float) -> None:
    for seq in seqs:
        for rank in ranks:
            d.report(rank, seq, start + seq + rank / 10)


def test_a_rank_that_left_keeps_its_rounds_and_a_stopped_groups_ranks_read_left() -> None:
    """Before: ROUNDS read 0 for every rank no longer registered while LAST IN kept its
    history, and the ranks of a stopped group read `missing` (`0 missing - - ... 0`)."""
    d = registered(2, on_rank_loss=OnRankLoss.NEUTRALIZE)
    _decide(d, (0, 1), range(30), 101.0)
    assert _rows(d) == [("registered", 30, 0), ("registered", 30, 30)]
    _leave(d, 1, 140.0)
    _decide(d, (0,), range(30, 35), 101.0)  # rank 1 left out: it takes part in none of these
    assert _rows(d) == [("registered", 35, 5), ("left", 30, 30)]
    _leave(d, 0, 150.0)
    assert d.snapshot().stopped
    assert _rows(d) == [("left", 35, 5), ("left", 30, 30)]
    table = render(json.loads(json.dumps(status_document(d))))
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [(row[0], row[1], row[-1]) for row in rows] == [("0", "left", "5"), ("1", "left", "30")]
    assert "ROUNDS: rounds decided while this rank was registered" in table


def test_a_lost_rank_of_a_stopped_group_is_not_said_to_have_left() -> None:
    d = registered(2, on_rank_loss=OnRankLoss.NEUTRALIZE)
    _decide(d, (0, 1), range(3), 101.0)
    d.lose(1, 110.0)
    _decide(d, (0,), range(3, 5), 101.0)
    _leave(d, 0, 120.0)
    assert _rows(d) == [("left", 5, 2), ("missing", 3, 3)]


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"url": None, "json": False, "group": None, "probe": None,
                                 "timeout": 2.0, **kw})


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The default address in an empty runtime directory, and a metrics port nobody serves."""
    for var in ("COORDD_ADDRESS", "COORDD_STATUS_URL", "COORDD_METRICS_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "coordd" / "coordd.sock"


def test_with_nothing_running_status_says_a_short_line_per_place_asked(
    nothing_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: one ~540-character line mixing both lookups, and a coordd that had just stopped
    read the same as one never started. Exit codes: 2 (the probe: 1)."""
    assert run(_args()) == 2
    never = capsys.readouterr().err.splitlines()
    assert never[0] == "coordd status: no coordd answered"
    assert never[1] == f"  ipc://{nothing_runs}: none was started there (no directory " \
                       f"{nothing_runs.parent})"
    assert never[2].startswith("start `coordd serve`, or give --address ipc://PATH")
    assert len(never) == 3
    assert max(len(line.replace(str(nothing_runs.parent), "D")) for line in never) <= 100
    nothing_runs.parent.mkdir()  # as a coordd that bound there and stopped leaves it
    assert run(_args()) == 2
    stopped = capsys.readouterr().err.splitlines()
    assert stopped[1] == f"  ipc://{nothing_runs}: none runs there now (its directory exists: " \
                         "one may have stopped)"
    assert run(_args(probe="readyz")) == 1
    assert capsys.readouterr().err.splitlines()[0] == "coordd status: no coordd answered"


class _Anyone(http.server.BaseHTTPRequestHandler):
    """Another user's listener on the deploy files' port: 200 to every GET."""

    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_dead_default_coordd_is_not_answered_for_by_another_port(
    nothing_runs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: with the default socket missing, or left by a coordd that is gone (it
    refuses), `coordd status` asked http://127.0.0.1:9180, so another process's listener there
    passed `--probe readyz` for a dead coordd. Now it says where it looked and exits non-zero,
    asking nothing else."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Anyone)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        # where 9e28cfc fell back to (its FALLBACK_URL); nothing to redirect once it is gone
        monkeypatch.setattr(
            "coordd.cli.status.FALLBACK_URL", f"http://127.0.0.1:{port}", raising=False
        )
        assert run(_args(probe="readyz")) == 1
        missing = capsys.readouterr()
        assert missing.out == ""
        assert f"ipc://{nothing_runs}: none was started there" in missing.err
        nothing_runs.parent.mkdir()
        left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left.bind(f"{nothing_runs}.http")  # bound, never listening: as a killed coordd leaves it
        left.close()
        assert run(_args(probe="livez")) == 1
        assert run(_args()) == 2
        refused = capsys.readouterr()
        assert refused.out == ""
        assert refused.err.count(
            f"ipc://{nothing_runs}: its status socket is left from a coordd that is gone"
        ) == 2
        assert _Anyone.hits == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_tcp_default_address_has_no_socket_to_ask_and_exits_2(
    nothing_runs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COORDD_ADDRESS", "tcp://127.0.0.1:5555")
    assert run(_args()) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == ("  tcp://127.0.0.1:5555: a coordd serves a status socket only beside an "
                      "ipc path")
    assert run(_args(probe="readyz")) == 1


def test_an_address_given_is_one_line_and_a_bad_one_exits_1(
    nothing_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(_args(url=f"ipc://{nothing_runs}")) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"coordd status: no coordd at ipc://{nothing_runs}: none was started there "
        f"(no directory {nothing_runs.parent})"
    ]
    assert run(_args(url="ftp://h:1")) == 1
    assert run(_args(url="http://h:port")) == 1
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_operations_md_states_the_exit_codes_status_has() -> None:
    """The exit codes were documented nowhere; now `coordd status --help` and
    docs/operations.md say the same (the runs above hold each code)."""
    from coordd.cli.status import EXIT_CODES

    text = " ".join((Path(__file__).parents[2] / "docs" / "operations.md").read_text().split())
    assert "The " + EXIT_CODES + "." in text


def test_the_status_socket_leaves_another_users_socket_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a socket of coordd's own uid left at PATH.http is a dead coordd's to replace:
    another user's is left where it is (its inode unchanged) and no status socket is served
    there. The other user is played by coordd's uid seen as another."""
    path = tmp_path / "c.sock.http"
    theirs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.bind(str(path))
    theirs.close()
    os.link(path, tmp_path / "kept")  # the inode lives on if the path is unlinked: not reused
    inode = os.lstat(path).st_ino
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)

    async def start() -> None:
        served = HttpEndpoints({"/livez": lambda params=None: (200, "text/plain", b"ok")})
        try:
            await served.start_unix(str(path))
        finally:
            await served.close()

    with pytest.raises(OSError):
        asyncio.run(start())
    assert os.lstat(path).st_ino == inode


def test_the_status_socket_follows_no_symlink_swapped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: coordd set PATH.http's mode by path after binding it, so a symlink swapped in
    meanwhile (in a directory others can write) had its target made 0600, and at exit coordd
    unlinked whatever was at the path. Now the mode comes from the umask at bind, and close()
    unlinks only the socket it bound."""
    path = tmp_path / "c.sock.http"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))  # a dead coordd's socket: replaced
    left.close()

    async def serve_and_close(connect: bool = True) -> tuple[int, int]:
        served = HttpEndpoints({"/livez": lambda params=None: (200, "text/plain", b"ok")})
        await served.start_unix(str(path))
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if connect:
            conn = asyncio.open_unix_connection(str(path))
            _reader, writer = await asyncio.wait_for(conn, 10)
            writer.close()
        victim_mode = stat.S_IMODE(victim.stat().st_mode)
        await served.close()
        return mode, victim_mode

    victim = tmp_path / "victim"
    victim.write_text("not coordd's")
    victim.chmod(0o644)
    assert asyncio.run(serve_and_close()) == (0o600, 0o644)
    assert not os.path.lexists(path)  # closed: its own socket removed

    real = asyncio.start_unix_server

    async def swapped(*args: Any, **kw: Any) -> asyncio.Server:
        server = await real(*args, **kw)
        os.symlink(victim, tmp_path / "link")
        os.replace(tmp_path / "link", path)  # another user swaps a symlink in, atomically
        return server

    monkeypatch.setattr(asyncio, "start_unix_server", swapped)
    assert asyncio.run(serve_and_close(connect=False))[1] == 0o644
    assert os.readlink(path) == str(victim)  # not coordd's socket: left where it is
