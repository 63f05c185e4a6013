"""An operable coordd, as an operator meets it: real processes, real sockets, real HTTP.

- /metrics and /status of a real coordd during real rounds, with the counts checked (and the
  straggler named: one rank is made late on purpose);
- /livez, /readyz and `coordd status` (the table and the probes) against the live process;
- CURVE over tcp://127.0.0.1: a rank with an admitted key works, one without is refused;
- an oversize frame is cut at the socket while the registered ranks keep coordinating;
- JSON log lines of a fault carry group, epoch, seq, kind and ranks;
- the default bind is ipc in a private (0700) runtime directory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.synchronize
import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from coordd.cli.status import fetch
from coordd.client._transport import CurveKeys
from coordd.client.sync import CoordClient
from coordd.proto import CoordinatorUnavailable, StepMismatch, StepReport

REPORT = StepReport(num_tokens=3, num_tokens_padded=8, want_ubatch=False, cudagraph_mode=1,
                    has_unfinished=True)


class Coordd:
    """A `coordd` process whose stdout is read unbuffered (the ready and metrics lines)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 stderr: Path | None = None) -> None:
        self.argv = [sys.executable, "-m", "coordd", *args]
        self.env = {**os.environ, **(env or {})}
        self.stderr_path = stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.url = ""

    def start(self, timeout: float = 30.0) -> Coordd:
        err = open(self.stderr_path, "wb") if self.stderr_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=err,
                                         env=self.env, start_new_session=True)
        finally:
            if err is not None:
                err.close()
        assert self.proc.stdout is not None
        want_url = "--metrics-port" in self.argv
        buffer = b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not self.address or (want_url and not self.url):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise TimeoutError(f"coordd not ready within {timeout}s: {self.argv}")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"coordd exited with {self.proc.wait(5)}: {self.argv}")
                buffer += chunk
                for line in buffer.decode().splitlines():
                    if line.startswith("coordd ready on "):
                        self.address = line.split(" on ", 1)[1].strip()
                    elif line.startswith("coordd metrics on "):
                        self.url = line.split(" on ", 1)[1].strip()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture
def coordd(tmp_path: Path) -> Iterator[Callable[..., Coordd]]:
    started: list[Coordd] = []

    def start(*args: str, env: dict[str, str] | None = None, stderr: Path | None = None,
              ) -> Coordd:
        proc = Coordd(list(args), env, stderr)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()


def http_args() -> list[str]:
    return ["--metrics-port", "0", "--log-level", "warning"]


def samples(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    code, body = fetch(url + "/metrics", 5)
    assert code == 200
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(m: dict[str, Any], name: str, **labels: str) -> float:
    return m.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def status(url: str) -> dict[str, Any]:
    code, body = fetch(url + "/status", 5)
    assert code == 200
    return json.loads(body)  # type: ignore[no-any-return]


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def coordd_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordd", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


# -- rank processes -------------------------------------------------------------------------------


def run_rank(address: str, rank: int, dp: int, rounds: int, late_rank: int, delay: float,
             out: mp.Queue, leave: multiprocessing.synchronize.Event,
             registered: multiprocessing.synchronize.Barrier) -> None:
    """Coordinate `rounds` rounds (rank `late_rank` reports `delay` late each time), report
    the decisions' seqs, then stay registered until `leave` is set. The rounds start once
    every rank has registered, so a process that started slowly is not late in the first."""
    try:
        with CoordClient(address, dp_rank=rank, dp_size=dp, config_fingerprint="ops") as c:
            c.connect(timeout=30)
            registered.wait(60)
            seqs = []
            for _ in range(rounds):
                if rank == late_rank:
                    time.sleep(delay)
                seqs.append(c.coordinate(REPORT, timeout=60).seq)
            out.put((rank, seqs, None))
            leave.wait(60)
    except Exception as exc:  # reported to the test, which fails on it
        out.put((rank, [], f"{type(exc).__name__}: {exc}"))


class Ranks:
    def __init__(self, address: str, dp: int, rounds: int, late_rank: int, delay: float) -> None:
        ctx = mp.get_context("spawn")
        self.out: mp.Queue = ctx.Queue()
        self.leave = ctx.Event()
        self.registered = ctx.Barrier(dp)  # held: the children open it by name
        self.procs = [
            ctx.Process(target=run_rank, daemon=True,
                        args=(address, r, dp, rounds, late_rank, delay, self.out, self.leave,
                              self.registered))
            for r in range(dp)
        ]
        for p in self.procs:
            p.start()

    def results(self, timeout: float) -> list[tuple[int, list[int], str | None]]:
        deadline = time.monotonic() + timeout
        got = [self.out.get(timeout=max(0.1, deadline - time.monotonic())) for _ in self.procs]
        return sorted(got)

    def close(self) -> None:
        self.leave.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


# -- tests --------------------------------------------------------------------------------------


def test_metrics_status_and_probes_during_real_rounds(coordd: Callable[..., Coordd],
                                                      tmp_path: Path) -> None:
    dp, rounds, late, delay = 3, 30, 2, 0.1
    c = coordd("serve", "--dp", str(dp), "--bind", f"ipc://{tmp_path}/c.sock", *http_args())
    assert c.url.startswith("http://127.0.0.1:"), "HTTP binds loopback unless asked"
    assert fetch(c.url + "/livez", 5) == (200, b"ok\n")
    assert fetch(c.url + "/readyz", 5) == (503, b"no group has registered yet\n")
    assert coordd_cli("status", "--url", c.url, "--probe", "readyz").returncode == 1

    ranks = Ranks(c.address, dp, rounds, late, delay)
    try:
        # during the rounds: ready, and `coordd status` renders the live group
        wait_for(lambda: (groups := status(c.url)["groups"]) and
                 groups[0]["rounds"]["completed"] >= 3, 90, "rounds to start")
        assert fetch(c.url + "/readyz", 5)[0] == 200
        probe = coordd_cli("status", "--url", c.url, "--probe", "readyz")
        assert probe.returncode == 0 and probe.stdout.startswith("readyz: 200"), probe
        table = coordd_cli("status", "--url", c.url)
        assert table.returncode == 0, table.stderr
        assert f"group default  dp {dp}" in table.stdout
        assert "ready: yes (1/1 groups formed (default: 3/3 ranks registered))" in table.stdout
        rows = [line.split() for line in table.stdout.splitlines()
                if line.strip()[:1].isdigit()]
        assert [(row[0], row[1]) for row in rows] == [(str(r), "registered") for r in range(dp)]

        results = ranks.results(timeout=90)
        assert [err for _, _, err in results] == [None] * dp
        assert all(seqs == list(range(rounds)) for _, seqs, _ in results)

        # after the rounds, still registered: the counts are exact
        m = samples(c.url)
        g = {"group": "default"}
        assert metric(m, "coordd_rounds_total", **g, kind="forward", outcome="decided") == rounds
        assert metric(m, "coordd_round_duration_seconds_count", **g, kind="forward") == rounds
        assert metric(m, "coordd_round_duration_seconds_bucket", **g, kind="forward",
                      le="+Inf") == rounds
        assert metric(m, "coordd_round_duration_seconds_sum", **g, kind="forward") > 0
        # issue 30: what each sync cost the ranks' steps, as they report it with their next
        # round: every rank's wait of every round but the last (no next report tells it)
        w = {**g, "site": "forward"}
        assert metric(m, "coordd_rank_wait_seconds_count", **w) == dp * (rounds - 1)
        assert metric(m, "coordd_rank_wait_seconds_bucket", **w, le="+Inf") == dp * (rounds - 1)
        assert metric(m, "coordd_rank_wait_seconds_sum", **w) > 0
        stragglers = {dict(k)["rank"]: v for k, v in m["coordd_straggler_rounds_total"].items()}
        assert sum(stragglers.values()) == rounds
        assert stragglers[str(late)] >= rounds - 3, f"rank {late} is the late one: {stragglers}"
        assert metric(m, "coordd_registered_ranks", **g) == dp
        assert metric(m, "coordd_dp_size") == dp
        assert metric(m, "coordd_groups") == 1
        assert metric(m, "coordd_ready") == 1
        assert metric(m, "coordd_round_seq", **g) == rounds
        assert metric(m, "coordd_registrations_total", **g) == dp
        assert metric(m, "coordd_frames_received_total") == dp * (rounds + 1)
        assert metric(m, "coordd_frames_sent_total") == dp * (rounds + 1)
        assert metric(m, "coordd_bad_frames_total") == 0
        assert "coordd_faults_total" not in m
        assert metric(m, "process_resident_memory_bytes") > 0
        (build,) = m["coordd_build_info"]
        assert dict(build)["protocol_version"] == "2"

        doc = status(c.url)
        assert doc["ready"] is True
        (doc,) = doc["groups"]
        assert doc["seq"] == rounds and doc["ready"] is True and doc["failure"] is None
        lateness = [r["mean_lateness_s"] for r in doc["ranks"]]
        assert lateness[late] > delay / 2
        assert all(lateness[r] < lateness[late] for r in range(dp) if r != late)
        assert [r["rounds"] for r in doc["ranks"]] == [rounds] * dp
        assert all(r["incarnation"] and r["last_seen_s"] < 60 for r in doc["ranks"])
    finally:
        ranks.close()
    # the ranks left cleanly (Goodbye): the group is stopped, not failed, and coordd says so
    m = wait_for(lambda: (s := samples(c.url)) and
                 metric(s, "coordd_group_stopped", group="default") == 1 and s,
                 30, "the group to stop once the ranks left")
    assert metric(m, "coordd_group_failed", group="default") == 0
    assert metric(m, "coordd_faults_total", group="default", reason="lost") == 0
    assert metric(m, "coordd_departures_total", group="default") == dp
    assert metric(m, "coordd_ready") == 1
    code, body = fetch(c.url + "/readyz", 5)
    assert code == 200 and body.startswith(b"1/1 groups stopped (default: stopped at seq"), body
    assert b"every rank left cleanly (Goodbye)" in body
    doc = status(c.url)["groups"][0]
    assert doc["state"] == "stopped" and doc["left_cleanly"] and doc["recent_failures"] == []
    assert c.alive()


def test_curve_admits_only_the_given_client_keys(coordd: Callable[..., Coordd], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    made = coordd_cli("keygen", "--dir", str(keys), "coordd", "rank", "intruder")
    assert made.returncode == 0, made.stderr
    refused = coordd_cli("serve", "--dp", "2", "--bind", "tcp://127.0.0.1:*")
    assert refused.returncode == 1 and "needs CURVE" in refused.stderr

    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "2", "--bind", "tcp://127.0.0.1:*",
               "--curve-secret-key", str(keys / "coordd.key_secret"),
               "--curve-client-keys", str(keys / "rank.key"), *http_args(),
               "--log-format", "json", stderr=log)
    assert c.address.startswith("tcp://127.0.0.1:")
    monkeypatch.delenv("COORDD_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("COORDD_CURVE_CLIENT_KEY", raising=False)
    good = CurveKeys.from_files(str(keys / "coordd.key"), str(keys / "rank.key_secret"))
    wrong_client = CurveKeys.from_files(str(keys / "coordd.key"),
                                        str(keys / "intruder.key_secret"))
    wrong_server = CurveKeys.from_files(str(keys / "intruder.key"), str(keys / "rank.key_secret"))

    def refused_with(curve: CurveKeys | None) -> str:
        with (CoordClient(c.address, dp_rank=0, dp_size=2, curve=curve) as client,
              pytest.raises(CoordinatorUnavailable) as info):
            client.connect(timeout=3)
        return str(info.value)

    assert "refused this rank's CURVE key" in refused_with(wrong_client)
    assert "CURVE handshake failed" in refused_with(wrong_server)
    assert "the security handshake failed" in refused_with(None)

    # the same key file for both ranks, as the deploy files do
    monkeypatch.setenv("COORDD_CURVE_SERVER_KEY", str(keys / "coordd.key"))
    monkeypatch.setenv("COORDD_CURVE_CLIENT_KEY", str(keys / "rank.key_secret"))
    ranks = [CoordClient(c.address, dp_rank=0, dp_size=2, curve=good),
             CoordClient(c.address, dp_rank=1, dp_size=2)]  # keys from the environment
    try:
        for r in ranks:
            r.connect(timeout=10)
        for seq in range(3):
            pending = [r.start(REPORT) for r in ranks]
            assert [p.wait(timeout=10).seq for p in pending] == [seq, seq]
    finally:
        for r in ranks:
            r.close()
    m = samples(c.url)
    assert metric(m, "coordd_curve_refused_total") >= 1
    assert metric(m, "coordd_rounds_total", group="default", kind="forward",
                  outcome="decided") == 3
    assert metric(m, "coordd_registrations_total", group="default") == 2, (
        "no refused client ever registered"
    )
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (refusal,) = [r for r in lines if r["message"] == "client refused"]
    intruder = (keys / "intruder.key").read_text().split('public-key = "')[1][:40]
    assert (refusal["kind"], refusal["ranks"], refusal["reason"], refusal["key"]) == (
        "connect", [], "curve_key", intruder
    )
    assert {"group", "epoch", "seq"} <= set(refusal)


def test_an_oversize_frame_is_cut_while_the_ranks_keep_coordinating(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    c = coordd("serve", "--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", *http_args())
    ranks = [CoordClient(c.address, dp_rank=r, dp_size=2) for r in range(2)]
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)
    intruder.linger = 0
    monitor = intruder.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        for r in ranks:
            r.connect(timeout=10)
        first = [r.start(REPORT) for r in ranks]
        intruder.connect(c.address)
        intruder.send(b"\xc1 not msgpack")  # a bad frame: decoded, dropped and counted
        intruder.send(b"x" * (1 << 20))  # 1 MiB > MAXMSGSIZE (64 KiB): the socket cuts it
        assert monitor.poll(10_000), "coordd closed the connection that sent the frame"
        assert [p.wait(timeout=10).seq for p in first] == [0, 0]
        for seq in range(1, 6):
            pending = [r.start(REPORT) for r in ranks]
            assert [p.wait(timeout=10).seq for p in pending] == [seq, seq]
        m = samples(c.url)
        assert metric(m, "coordd_bad_frames_total") == 1
        assert metric(m, "coordd_registered_ranks", group="default") == 2
        assert "coordd_faults_total" not in m
        assert c.alive()
    finally:
        for r in ranks:
            r.close()
        intruder.disable_monitor()
        monitor.close(0)
        intruder.close(0)
        ctx.term()


def test_json_fault_lines_carry_group_epoch_seq_kind_and_ranks(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock",
               "--log-format", "json", "--groups", "g7", stderr=log)
    ranks = [CoordClient(c.address, dp_rank=r, dp_size=2, group="g7") for r in range(2)]
    try:
        for r in ranks:
            r.connect(timeout=10)
        welcome_epoch = ranks[0].epoch
        assert [p.wait(timeout=10).seq for p in [r.start(REPORT) for r in ranks]] == [0, 0]
        forward = ranks[0].start(REPORT, "forward")
        draft = ranks[1].start(REPORT, "draft")  # the ranks disagree on round 1's kind
        for pending in (forward, draft):
            with pytest.raises(StepMismatch):
                pending.wait(timeout=10)
    finally:
        for r in ranks:
            r.close()

    def fault_line() -> dict[str, Any] | None:
        for line in log.read_text().splitlines():
            record = json.loads(line)  # every line is one JSON object
            if record["message"] == "group failed":
                return record  # type: ignore[no-any-return]
        return None

    record = wait_for(fault_line, 10, "the fault line")
    assert record["level"] == "warning"
    assert (record["group"], record["epoch"], record["seq"], record["reason"]) == (
        "g7", welcome_epoch, 1, "mismatch"
    )
    assert record["kind"] in ("forward", "draft") and len(record["ranks"]) == 1
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    registered = [r for r in lines if r["message"] == "rank registered"]
    assert sorted(r["rank"] for r in registered) == [0, 1]
    assert all(r["group"] == "g7" for r in registered)


def test_the_default_bind_is_ipc_in_a_private_directory(coordd: Callable[..., Coordd],
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = {"XDG_RUNTIME_DIR": str(xdg), "COORDD_ADDRESS": ""}
    c = coordd("serve", "--dp", "1", "--log-level", "warning", env=env)
    assert c.address == f"ipc://{xdg}/coordd/coordd.sock"
    assert stat.S_IMODE(os.stat(xdg / "coordd").st_mode) == 0o700
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    with CoordClient(dp_rank=0, dp_size=1) as client:  # finds it with no address given
        client.connect(timeout=10)
        assert client.coordinate(REPORT, timeout=10).seq == 0


def test_a_busy_metrics_port_stops_coordd_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = coordd_cli("serve", "--dp", "1", "--bind", f"ipc://{tmp_path}/c.sock",
                          "--metrics-port", str(port))
    assert done.returncode == 1
    # named as the option to change (before: "cannot serve HTTP on ...: [Errno 98] ...")
    assert f"coordd: --metrics-port {port}: 127.0.0.1:{port} is in use" in done.stderr
    assert "[Errno" not in done.stderr and "0 for any free one" in done.stderr
    unreachable = coordd_cli("status", "--url", f"http://127.0.0.1:{port}", "--timeout", "2")
    assert unreachable.returncode == 2 and "no coordd at" in unreachable.stderr


def test_coordd_status_with_no_flags_finds_the_users_coordd(coordd: Callable[..., Coordd],
                                                           tmp_path: Path) -> None:
    """Issue 30: the Quick start's `coordd serve --dp 2` has no metrics port, and `coordd
    status` only tried 127.0.0.1:9180: exit 2, "cannot reach coordd". coordd now serves its
    endpoints on a status socket beside its ipc socket (PATH.http, mode 0600, no flag), and
    `coordd status` with no flags asks the default address's."""
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
    for var in ("COORDD_ADDRESS", "COORDD_METRICS_PORT", "COORDD_STATUS_URL"):
        env.pop(var, None)

    def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "coordd", "status", *args],
                              capture_output=True, text=True, timeout=30, env=env, check=False)

    sock = xdg / "coordd" / "coordd.sock"
    before = status_cli("--timeout", "2")
    assert before.returncode == 2 and "Traceback" not in before.stderr
    assert f"  ipc://{sock}: none was started there" in before.stderr, before.stderr
    assert "start `coordd serve`" in before.stderr

    c = coordd("serve", "--dp", "2", "--log-level", "warning", env=env)
    assert c.address == f"ipc://{sock}" and not c.url  # no --metrics-port
    http = Path(f"{sock}.http")
    assert stat.S_ISSOCK(os.lstat(http).st_mode)
    assert stat.S_IMODE(os.lstat(http).st_mode) == 0o600
    table = status_cli()
    assert table.returncode == 0, table.stderr
    assert f"at ipc://{sock}, pid {c.proc.pid if c.proc else 0}" in table.stdout
    assert "ready: NO (no group has registered yet)" in table.stdout
    probe = status_cli("--probe", "readyz")
    assert probe.returncode == 1
    assert probe.stdout.strip() == "readyz: 503 no group has registered yet"
    given = status_cli("--address", c.address, "--json")
    assert given.returncode == 0 and json.loads(given.stdout)["coordd"]["address"] == c.address
    tcp = status_cli("--address", "tcp://127.0.0.1:5555")
    assert tcp.returncode == 1 and len(tcp.stderr.strip().splitlines()) == 1
    assert "--address http://HOST:PORT" in tcp.stderr

    assert c.stop() == 0
    assert not http.exists(), "coordd removes its status socket at exit"


def test_both_clients_tell_their_waits_by_site(coordd: Callable[..., Coordd],
                                              tmp_path: Path) -> None:
    """Issue 30: what each sync costs a rank's step, from the asyncio client's policy rounds
    and the blocking client's gather rounds (the vLLM plugin's kind): one wait per rank and
    round but the last, under the round's site."""
    import asyncio

    from coordd.client.aio import AsyncCoordClient

    rounds = 5
    c = coordd("serve", "--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", *http_args())

    async def policy_rounds() -> None:
        clients = [AsyncCoordClient(c.address, dp_rank=r, dp_size=2, group="dp-tp0-pp0")
                   for r in range(2)]
        try:
            for client in clients:
                await client.connect(timeout=10)
            for _ in range(rounds):
                await asyncio.gather(*(client.coordinate(REPORT, timeout=30)
                                       for client in clients))
        finally:
            for client in clients:
                await client.close()

    asyncio.run(policy_rounds())
    ranks = [CoordClient(c.address, dp_rank=r, dp_size=2) for r in range(2)]
    try:
        for r in ranks:
            r.connect(timeout=10)
        for seq in range(rounds):
            pending = [r.start_gather("v1.dp_utils", [seq, r.dp_rank]) for r in ranks]
            rows = [p.wait(timeout=30) for p in pending]
            assert rows == [[[seq, 0], [seq, 1]]] * 2
    finally:
        for r in ranks:
            r.close()
    m = samples(c.url)
    want = 2 * (rounds - 1)
    assert metric(m, "coordd_rank_wait_seconds_count", group="dp-tp0-pp0", site="forward") == want
    assert metric(m, "coordd_rank_wait_seconds_count", group="default", site="v1.dp_utils") == want


def test_a_dead_coordds_status_socket_is_replaced(coordd: Callable[..., Coordd],
                                                  tmp_path: Path) -> None:
    """A SIGKILLed coordd leaves PATH.http behind; the next coordd on the path (holding its
    lock) replaces it, and `coordd status --address` asks the live one."""
    sock = tmp_path / "c.sock"
    first = coordd("serve", "--dp", "1", "--bind", f"ipc://{sock}", "--log-level", "warning")
    assert first.proc is not None
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert Path(f"{sock}.http").exists(), "left behind by the killed coordd"
    gone = coordd_cli("status", "--address", f"ipc://{sock}", "--timeout", "2")
    assert gone.returncode == 2 and "its status socket is left from a coordd that is gone" \
        in gone.stderr, gone.stderr
    second = coordd("serve", "--dp", "1", "--bind", f"ipc://{sock}", "--log-level", "warning")
    assert second.proc is not None
    table = coordd_cli("status", "--address", f"ipc://{sock}")
    assert table.returncode == 0, table.stderr
    assert f"pid {second.proc.pid}" in table.stdout
