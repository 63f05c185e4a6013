"""Misuse by a user gets a sentence, not a traceback (issue 11, C and D): real coordd processes,
real sockets, real clients, as a new user would meet them."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from coordd.client import CoordClient, CurveKeys, RoundStillOpen
from coordd.io._curve import write_keypair
from coordd.proto import CoordError, CoordinatorUnavailable, RankLost, StepMismatch, StepReport
from coordd.testing import CoorddProcess
from tests.integration.test_operability import Coordd

REPORT = StepReport(num_tokens=3, num_tokens_padded=8)
COORDD = [sys.executable, "-m", "coordd"]


def run_coordd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COORDD, *args], capture_output=True, text=True, timeout=timeout)


def one_line_refusal(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if " WARNING " not in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


def clients(address: str, dp: int, **options: object) -> list[CoordClient]:
    cs = [CoordClient(address, dp_rank=r, dp_size=dp, config_fingerprint="fp", **options)
          for r in range(dp)]
    for c in cs:
        c.connect(timeout=10)
    return cs


def close_all(cs: list[CoordClient]) -> None:
    for c in cs:
        c.close()


# -- where coordd listens -----------------------------------------------------------------------


def test_a_second_coordd_on_the_same_path_is_refused_and_the_first_keeps_its_socket(
    tmp_path: Path,
) -> None:
    """Before: the second took the socket over silently (libzmq unlinks the path on bind), the
    first was unreachable, and the second deleted the socket when it exited."""
    bind = f"ipc://{tmp_path}/coordd.sock"
    with CoorddProcess(2, bind, ["--log-level", "warning"]) as first:
        line = one_line_refusal(run_coordd("--dp", "2", "--bind", bind))
        assert line == (f"coordd: --bind {bind}: another coordd (pid {first.pid}) serves this "
                        "path: stop it first, or give this one another --bind")
        assert stat.S_ISSOCK(os.lstat(tmp_path / "coordd.sock").st_mode), "the socket is gone"
        cs = clients(first.address, 2)  # the first still answers at its path
        try:
            pending = [c.start(REPORT) for c in cs]
            assert pending[0].wait(10) == pending[1].wait(10)
        finally:
            close_all(cs)
    assert not (tmp_path / "coordd.sock").exists(), "coordd removes its own socket at exit"


def test_coordd_never_unlinks_a_socket_that_is_not_its_own(tmp_path: Path) -> None:
    path = tmp_path / "coordd.sock"
    coordd = CoorddProcess(1, f"ipc://{path}", ["--log-level", "warning"]).start()
    try:
        os.unlink(path)
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(path))  # another program's socket, at the path coordd had
        assert coordd.stop() == 0
        assert stat.S_ISSOCK(os.lstat(path).st_mode), "coordd removed a socket it did not bind"
        other.close()
    finally:
        coordd.stop()


def test_the_socket_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    """Before: a socket in an existing directory took the process umask (0777 at umask 000)."""
    path = tmp_path / "coordd.sock"
    proc = subprocess.Popen([*COORDD, "--dp", "1", "--bind", f"ipc://{path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, umask=0)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"coordd ready on ")
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def _busy_port() -> tuple[socket.socket, int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def test_an_ipc_bind_into_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    """Before: `--bind ipc:///nonexistent/dir/x.sock` made the directories, said "coordd
    ready" and left them behind."""
    done = run_coordd("--dp", "1", "--bind", f"ipc://{tmp_path}/nonexistent/dir/x.sock")
    line = one_line_refusal(done)
    assert line.startswith(f"coordd: --bind ipc://{tmp_path}/nonexistent/dir/x.sock: "), line
    assert f"directory {tmp_path}/nonexistent/dir does not exist" in line
    assert "coordd ready" not in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_every_bad_bind_is_one_line_naming_the_option_and_the_fix(tmp_path: Path) -> None:
    """Before: raw ZMQError tracebacks (and exit code 1 only by accident of the traceback)."""
    held, port = _busy_port()
    (tmp_path / "file").write_text("")
    try:
        cases = {
            f"tcp://127.0.0.1:{port}": f"port {port} is in use on 127.0.0.1",
            "tcp://no-such-host.invalid:5555": "cannot resolve host 'no-such-host.invalid'",
            "tcp://192.0.2.1:5555": "192.0.2.1 is not an address of this machine",
            "tcp://127.0.0.1": "has no port: write tcp://127.0.0.1:PORT",
            "127.0.0.1:5555": "has no scheme: write tcp://127.0.0.1:5555",
            f"ipc://{tmp_path}/file/coordd.sock": "is not a directory",
            "ipc:///proc/1/coordd.sock": "cannot create files in /proc/1",
            "ipc:///tmp/" + "d" * 110 + ".sock": "longer than a UNIX socket address holds",
        }
        for bind, says in cases.items():
            line = one_line_refusal(run_coordd("--dp", "2", "--insecure", "--bind", bind))
            assert line.startswith(f"coordd: --bind {bind}: "), line
            assert says in line, line
    finally:
        held.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_coordd_and_clients() -> None:
    """Before: `--bind tcp://[::1]:P` died with a traceback (ZMQ_IPV6 never set)."""
    with CoorddProcess(2, "tcp://[::1]:*", ["--insecure", "--log-level", "warning"]) as coordd:
        assert coordd.address.startswith("tcp://[::1]:")
        cs = clients(coordd.address, 2)
        try:
            pending = [c.start(REPORT) for c in cs]
            assert pending[0].wait(10) == pending[1].wait(10)
        finally:
            close_all(cs)


# -- a client that cannot reach coordd ----------------------------------------------------------


def test_a_client_given_a_bad_address_gets_a_coord_error() -> None:
    for address, says in [("localhost:5555", "has no scheme: write tcp://localhost:5555"),
                          ("tcp://127.0.0.1", "has no port")]:
        with pytest.raises(CoordinatorUnavailable) as caught:
            CoordClient(address, dp_rank=0, dp_size=2)
        assert isinstance(caught.value, CoordError) and says in str(caught.value)
        # the hint is about the address, not "check that coordd is running"
        assert "--bind" in caught.value.hint and "running" not in caught.value.hint


def test_no_coordd_says_what_was_tried_and_why(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: "no answer from coordd at ... within 5s", whatever the cause."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    path = tmp_path / "coordd.sock"

    def refusal(address: str | None = None) -> str:
        c = CoordClient(address, dp_rank=0, dp_size=2)
        try:
            with pytest.raises(CoordinatorUnavailable) as caught:
                c.connect(timeout=0.5)
        finally:
            c.close()
        text = str(caught.value)
        assert "CURVE" not in text, "ipc: never blame CURVE when coordd is gone"
        return text

    text = refusal(f"ipc://{path}")
    assert f"no socket file at {path}" in text and "as given" in text
    monkeypatch.setenv("COORDD_ADDRESS", f"ipc://{path}")
    assert "from $COORDD_ADDRESS" in refusal()
    monkeypatch.delenv("COORDD_ADDRESS")
    text = refusal()
    assert "the default" in text and f"{tmp_path}/xdg/coordd/coordd.sock" in text

    coordd = CoorddProcess(2, f"ipc://{path}", ["--log-level", "warning"]).start()
    coordd.signal(signal.SIGKILL)  # gone without removing its socket
    assert coordd.proc is not None
    coordd.proc.wait(10)
    coordd.stop()
    assert "exists but nothing listens on it: coordd is gone" in refusal(f"ipc://{path}")


def test_no_coordd_on_tcp_says_connection_refused() -> None:
    held, port = _busy_port()
    held.close()  # a port nobody listens on now
    c = CoordClient(f"tcp://127.0.0.1:{port}", dp_rank=0, dp_size=2)
    try:
        with pytest.raises(CoordinatorUnavailable, match="connection refused: nothing listens"):
            c.connect(timeout=0.5)
    finally:
        c.close()


def test_a_refused_curve_key_fails_at_the_handshake(tmp_path: Path) -> None:
    """Before: the client waited the whole connect timeout, then said "no answer"."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("coordd", "rank", "stranger"):
        write_keypair(str(keys), name)
    args = ["--curve-secret-key", str(keys / "coordd.key_secret"),
            "--curve-client-keys", str(keys / "rank.key"), "--log-level", "error"]
    with CoorddProcess(1, "tcp://127.0.0.1:*", args) as coordd:
        for server, client, says, hint in [
            ("coordd", "stranger", "refused this rank's CURVE key", "--curve-client-keys"),
            ("stranger", "rank", "CURVE handshake failed", "COORDD_CURVE_SERVER_KEY"),
        ]:
            curve = CurveKeys.from_files(str(keys / f"{server}.key"),
                                         str(keys / f"{client}.key_secret"))
            c = CoordClient(coordd.address, dp_rank=0, dp_size=1, curve=curve)
            began = time.monotonic()
            try:
                with pytest.raises(CoordinatorUnavailable, match=says) as caught:
                    c.connect(timeout=30)
            finally:
                c.close()
            assert hint in caught.value.hint and "running" not in caught.value.hint
            assert caught.value.__notes__ == [f"hint: {caught.value.hint}"]
            assert time.monotonic() - began < 15, "it waited for the timeout"


# -- the client's own misuse -------------------------------------------------------------------


def test_a_second_wait_returns_the_same_outcome(start_coordd) -> None:  # type: ignore[no-untyped-def]
    """Before: the second wait() on a pending step blocked for its whole timeout."""
    coordd = start_coordd(2)
    cs = clients(coordd.address, 2)
    try:
        pending = [c.start(REPORT) for c in cs]
        first = pending[0].wait(10)
        assert pending[0].wait(1) == first and pending[0].done()
        # a failed round: the same error again
        a = cs[0].start(REPORT, "draft")
        cs[0].ping()
        b = cs[1].start(REPORT, "forward")
        with pytest.raises(StepMismatch) as one:
            a.wait(10)
        with pytest.raises(StepMismatch) as two:
            a.wait(1)
        assert one.value == two.value
        with pytest.raises(StepMismatch) as one:
            b.wait(10)
        with pytest.raises(StepMismatch) as two:
            b.wait(1)
        assert one.value == two.value
    finally:
        close_all(cs)


def test_close_from_another_thread_ends_a_wait_with_a_coord_error(start_coordd) -> None:  # type: ignore[no-untyped-def]
    """Before: the waiting thread got a raw ZMQError (or worse: libzmq sockets are not
    thread-safe, and close() ran while the other thread polled)."""
    coordd = start_coordd(2)
    cs = clients(coordd.address, 2)
    try:
        pending = cs[0].start(REPORT)  # rank 1 never reports: the wait would last 30 s
        threading.Timer(0.3, cs[0].close).start()
        began = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match="client closed"):
            pending.wait(30)
        assert time.monotonic() - began < 20
        with pytest.raises(CoordinatorUnavailable, match="client closed"):
            pending.wait(1)
        with pytest.raises(CoordinatorUnavailable, match="client closed"):
            cs[0].start(REPORT)
    finally:
        close_all(cs)


def test_start_twice_without_wait_is_refused(start_coordd) -> None:  # type: ignore[no-untyped-def]
    """Before: the second start's report went out at once; it worked only when ZeroMQ's fair
    queueing happened to deliver the other ranks' first reports before it (else StepMismatch)."""
    coordd = start_coordd(2)
    cs = clients(coordd.address, 2)
    try:
        mine = cs[0].start(REPORT)
        with pytest.raises(RoundStillOpen, match="rank 0: start\\(\\) while round seq=0"):
            cs[0].start(REPORT)
        with pytest.raises(RoundStillOpen):
            cs[0].start_gather("site", [1])
        theirs = cs[1].start(REPORT)
        assert mine.wait(10) == theirs.wait(10)
        pending = [c.start(REPORT) for c in cs]  # answered: the next round may start
        assert pending[0].wait(10).seq == 1
        pending[1].wait(10)
        # an answer that arrived but was not collected yet does not hold the next start
        pending = [c.start(REPORT) for c in cs]
        pending[1].wait(10)
        deadline = time.monotonic() + 10
        while not pending[0].done() and time.monotonic() < deadline:
            time.sleep(0.01)
        nxt = [c.start(REPORT) for c in cs]
        assert pending[0].wait(1).seq == 2 and nxt[0].wait(10) == nxt[1].wait(10)
    finally:
        close_all(cs)


async def _aio_start_twice(address: str) -> None:
    from coordd.client import AsyncCoordClient

    cs = [AsyncCoordClient(address, dp_rank=r, dp_size=2) for r in range(2)]
    try:
        for c in cs:
            await c.connect(timeout=10)
        mine = cs[0].start(REPORT)
        with pytest.raises(RoundStillOpen):
            cs[0].start(REPORT)
        theirs = cs[1].start(REPORT)
        assert await cs[0].wait(mine, 10) == await cs[1].wait(theirs, 10)
        assert await cs[0].wait(mine, 1) == await cs[1].wait(theirs, 1)  # the same again
    finally:
        for c in cs:
            await c.close()


def test_aio_start_twice_without_wait_is_refused(start_coordd) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    asyncio.run(_aio_start_twice(start_coordd(2).address))


# -- a rank that leaves cleanly -----------------------------------------------------------------


def _records(log: Path, message: str, timeout: float = 10.0) -> list[dict[str, object]]:
    """coordd's JSON log records so far, once one says `message` (or the deadline passes)."""
    deadline = time.monotonic() + timeout
    records: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in log.read_text().splitlines() if line]
        if any(r["message"] == message for r in records):
            break
        time.sleep(0.05)
    return records


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_a_group_every_rank_left_cleanly_is_stopped_not_failed(tmp_path: Path) -> None:
    """Before: a clean exit was logged "group stopped: a rank left" but counted as a failure
    (coordd_group_failed 1, faults lost 1), /readyz 503 and `coordd status` FAILED."""
    log = tmp_path / "coordd.log"
    coordd = Coordd(["--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", "--metrics-port", "0",
                     "--log-format", "json"], stderr=log).start()
    try:
        cs = clients(coordd.address, 2)
        pending = [c.start(REPORT) for c in cs]
        for p in pending:
            p.wait(10)
        cs[1].close()  # Goodbye
        cs[0].close()  # Goodbye: every rank left
        records = _records(log, "group stopped")
        stops = [r for r in records if r["message"] == "group stopped"]
        assert len(stops) == 1, records  # failed once in CI (run 25): the log says why
        (stopped,) = stops
        assert stopped["level"] == "info" and stopped["group"] == "default"
        assert not [r for r in records if r["message"] in ("group failed", "rank lost")]
        url = coordd.url
        assert _metric(url, "coordd_group_failed", group="default") == 0
        assert _metric(url, "coordd_group_stopped", group="default") == 1
        assert _metric(url, "coordd_departures_total", group="default") == 2
        assert _metric(url, "coordd_group_stops_total", group="default") == 1
        assert _metric(url, "coordd_faults_total", group="default", reason="lost") == 0
        assert _metric(url, "coordd_rounds_total", group="default", kind="forward",
                       outcome="failed") == 0
        assert _metric(url, "coordd_group_state", group="default", state="stopped") == 1
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            body = response.read().decode()
        assert body.startswith("1/1 groups stopped (default: stopped at seq 1: every rank left "
                               "cleanly (Goodbye)"), body
        table = subprocess.run([*COORDD, "status", "--url", url], capture_output=True,
                               text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "state stopped" in table.stdout and "every rank left cleanly" in table.stdout
        assert "FAILED" not in table.stdout
        # and the next registration starts a new epoch
        again = clients(coordd.address, 2)
        try:
            for p in [c.start(REPORT) for c in again]:
                p.wait(10)
            assert _metric(url, "coordd_epoch", group="default") >= 2
        finally:
            for c in again:
                c.close()
    finally:
        coordd.stop()


def test_a_report_after_a_peer_left_fails_naming_it_and_a_crash_stays_lost(
    tmp_path: Path,
) -> None:
    """A rank that left while another still syncs: that round fails (typed, naming the rank
    that left); a connection closed without Goodbye is a lost rank."""
    log = tmp_path / "coordd.log"
    coordd = Coordd(["--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", "--metrics-port", "0",
                     "--log-format", "json"], stderr=log).start()
    try:
        cs = clients(coordd.address, 2)
        for p in [c.start(REPORT) for c in cs]:
            p.wait(10)
        cs[1].close()  # Goodbye
        with pytest.raises(RankLost) as lost:
            cs[0].start(REPORT).wait(10)
        assert lost.value.ranks == (1,) and lost.value.detail == "left the group"
        cs[0].close()
        records = _records(log, "group failed")
        (failed,) = [r for r in records if r["message"] == "group failed"]
        assert failed["level"] == "warning" and failed["ranks"] == [1]
        assert _metric(coordd.url, "coordd_group_failed", group="default") == 1
        assert _metric(coordd.url, "coordd_group_stops_total", group="default") == 0
        try:
            urllib.request.urlopen(coordd.url + "/readyz", timeout=5)
            raise AssertionError("/readyz answered 200 after a failed round")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode()
            assert exc.code == 503
        # every rank has left: a group not formed (issue 21), its reason the departure
        assert body.startswith("0/1 groups formed: group default has failed at seq 1: "
                               "rank(s) [1] left the group (closed cleanly)"), body
    finally:
        coordd.stop()


# -- coordd status ------------------------------------------------------------------------------


def test_status_without_metrics_says_to_start_coordd_with_metrics_port() -> None:
    held, port = _busy_port()
    held.close()
    done = subprocess.run([*COORDD, "status", "--url", f"http://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "connection refused" in done.stderr and "--metrics-port" in done.stderr


def test_status_into_a_closed_pipe_and_its_footnote(tmp_path: Path) -> None:
    coordd = Coordd(["--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", "--metrics-port", "0",
                     "--log-level", "warning"]).start()
    try:
        cs = clients(coordd.address, 2)
        try:
            table = subprocess.run([*COORDD, "status", "--url", coordd.url], capture_output=True,
                                   text=True, timeout=30)
            lines = table.stdout.splitlines()
            header = next(line for line in lines if line.strip().startswith("RANK"))
            footnote = next(line for line in lines if line.strip().startswith("(ROUNDS:"))
            for part in footnote.strip(" ()").split("; "):
                column = part.split(":", 1)[0]
                assert column in header, f"the footnote names {column!r}, not a column"
            # `coordd status | head`: the reader goes away before coordd status writes
            proc = subprocess.Popen([*COORDD, "status", "--url", coordd.url],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            err = proc.stderr.read().decode()
            proc.stderr.close()
            assert proc.wait(30) == 0, err
            assert "Traceback" not in err and "BrokenPipe" not in err, err
        finally:
            close_all(cs)
    finally:
        coordd.stop()


def test_demo_over_tcp_needs_insecure_or_keys() -> None:
    """Before: `coordd demo --bind tcp://...` ended in a traceback."""
    done = subprocess.run([*COORDD, "demo", "--bind", "tcp://127.0.0.1:*", "--rounds", "5"],
                          capture_output=True, text=True, timeout=60)
    line = one_line_refusal(done)
    assert "needs CURVE" in line and "--insecure" in line
    done = subprocess.run([*COORDD, "demo", "--dp", "2", "--bind", "tcp://127.0.0.1:*",
                           "--insecure", "--rounds", "10", "--plain"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "every rank got the same decision" in done.stdout


def test_the_readme_client_snippet_runs_as_pasted(tmp_path: Path) -> None:
    """Before: the snippet used ipc:///run/coordd/coordd.sock (not coordd's default) and
    placeholders; now it must run as it stands against `coordd --dp 1` at the default address."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("## The client inside an engine"):]
    snippet = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("COORDD_ADDRESS", None)
    proc = subprocess.Popen([*COORDD, "--dp", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().decode()
        assert ready == f"coordd ready on ipc://{tmp_path}/coordd/coordd.sock\n", ready
        done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                              env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[8]"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_an_int32_overflow_fails_the_round_for_every_rank_naming_the_culprit(
    start_coordd,  # type: ignore[no-untyped-def]
) -> None:
    """Before: coordd decided the round, and every rank's vLLM adapter then failed building its
    int32 tensor with an untyped RuntimeError."""
    from coordd.proto import InvalidReport

    coordd = start_coordd(2)
    cs = clients(coordd.address, 2)
    try:
        a = cs[0].start(REPORT)
        cs[0].ping()  # rank 0's report reaches coordd first: the round is open
        b = cs[1].start(StepReport(num_tokens=2**31, num_tokens_padded=2**31))
        errors = []
        for pending in (a, b):
            with pytest.raises(InvalidReport) as caught:
                pending.wait(10)
            errors.append(caught.value)
        assert errors[0] == errors[1]
        assert (errors[0].rank, errors[0].field, errors[0].value) == (1, "num_tokens", 2**31)
        assert "0..2147483647" in errors[0].expected
    finally:
        close_all(cs)
