"""One coordd serving several named groups at once, as vLLM needs it: real coordd processes,
real ZeroMQ clients, real HTTP.

vLLM builds one DP group per TP/PP position of its workers plus one for its engine cores, all
with the same dp size; each is its own group here (its own rounds, seq, epoch and metrics
label). Checked: rounds of three groups interleaved; a fault, a step timeout and a killed rank
in one group leave the others deciding; `--max-groups` refuses a new group with
`Rejected(group_limit)` (and a group whose ranks all left gives its slot up); a bad group name
and a second group on one connection are refused naming the field; /metrics, /status,
`coordd status` and /readyz per group, `--expect-groups` included.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.synchronize
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from coordd.cli.status import fetch
from coordd.client import CoordClient
from coordd.core._settings import ServerSettings
from coordd.io._server import CoordServer
from coordd.proto import (
    RankLost,
    Rejected,
    StepKind,
    StepMismatch,
    StepReport,
    StepTimeout,
    decide,
)
from coordd.proto.messages import (
    Hello,
    Reject,
    StepFailed,
    Welcome,
    decode_from_coordinator,
    encode,
)
from tests.integration.test_operability import (
    Coordd,
    coordd_cli,
    metric,
    samples,
    status,
    wait_for,
)

WORKERS = ("dp-tp0-pp0", "dp-tp1-pp0")
ENGINE = "enginecore"
GROUPS = (ENGINE, *WORKERS)


@pytest.fixture
def coordd() -> Iterator[Callable[..., Coordd]]:
    """Start real coordd processes (stdout read for the ready and metrics lines); every one is
    stopped at teardown."""
    started: list[Coordd] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Coordd:
        proc = Coordd(list(args), env)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()


def report(rank: int, seq: int) -> StepReport:
    return StepReport(num_tokens=(rank + seq) % 8, num_tokens_padded=8, want_ubatch=False,
                      cudagraph_mode=1, has_unfinished=True)


def serve(coordd: Callable[..., Coordd], tmp_path: Path, dp: int, *args: str,
          env: dict[str, str] | None = None) -> Coordd:
    return coordd("serve", "--dp", str(dp), "--bind", f"ipc://{tmp_path}/c.sock",
                  "--metrics-port", "0", "--log-level", "warning", *args, env=env)


def join(address: str, group: str, dp: int, **kw: object) -> list[CoordClient]:
    clients = [CoordClient(address, dp_rank=r, dp_size=dp, group=group,
                           config_fingerprint=f"fp-{group}", **kw)  # type: ignore[arg-type]
               for r in range(dp)]
    for c in clients:
        c.connect(timeout=10)
    return clients


def close(*groups: list[CoordClient]) -> None:
    for clients in groups:
        for c in clients:
            c.close()


def round_of(clients: list[CoordClient], seq: int, kind: str = "forward") -> None:
    """One round of every rank of a group: the decision is the policy's, the same for all."""
    reports = [report(r, seq) for r in range(len(clients))]
    pending = [c.start(rep, kind) for c, rep in zip(clients, reports, strict=True)]
    got = [p.wait(timeout=15) for p in pending]
    assert all(d == got[0] for d in got)
    assert got[0].seq == seq
    assert got[0] == decide(reports, epoch=got[0].epoch, seq=seq, kind=StepKind(kind))


def test_interleaved_groups_and_a_fault_in_one_leaves_the_others_deciding(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    dp = 2
    c = serve(coordd, tmp_path, dp)
    groups = {name: join(c.address, name, dp) for name in GROUPS}
    rng = random.Random(12)
    try:
        epochs = {name: clients[0].epoch for name, clients in groups.items()}
        assert len(set(epochs.values())) == 3, f"each group has its own epoch: {epochs}"
        # interleaved: every step, both worker groups run a forward round and (every 4th
        # step) the engine cores a state round, the reports of all groups mixed in one order
        seqs = dict.fromkeys(GROUPS, 0)
        for step in range(12):
            started = []
            names = [*WORKERS, *([ENGINE] if step % 4 == 0 else [])]
            moves = [(name, rank) for name in names for rank in range(dp)]
            rng.shuffle(moves)
            for name, rank in moves:
                kind = "state" if name == ENGINE else "forward"
                started.append((name, rank, groups[name][rank].start(
                    report(rank, seqs[name]), kind)))
            decided = {}
            for name, _rank, pending in started:
                decided.setdefault(name, []).append(pending.wait(timeout=15))
            for name, decisions in decided.items():
                assert {d.seq for d in decisions} == {seqs[name]}
                assert all(d == decisions[0] for d in decisions)
                seqs[name] += 1
        assert seqs == {ENGINE: 3, WORKERS[0]: 12, WORKERS[1]: 12}

        # a fault in dp-tp1-pp0 (its ranks disagree on the kind) while dp-tp0-pp0 has a
        # round open: tp0's round still completes, tp1 alone fails
        tp0, tp1 = groups[WORKERS[0]], groups[WORKERS[1]]
        open_tp0 = tp0[0].start(report(0, 12))
        forward = tp1[0].start(report(0, 12), "forward")
        draft = tp1[1].start(report(1, 12), "draft")
        for pending in (forward, draft):
            with pytest.raises(StepMismatch) as info:
                pending.wait(timeout=15)
            assert info.value.expected_seq == 12
        rest = tp0[1].start(report(1, 12))
        assert open_tp0.wait(timeout=15) == rest.wait(timeout=15)
        m = samples(c.url)
        assert metric(m, "coordd_group_failed", group=WORKERS[1]) == 1
        assert metric(m, "coordd_group_failed", group=WORKERS[0]) == 0
        assert metric(m, "coordd_faults_total", group=WORKERS[1], reason="mismatch") == 1
        assert not any(dict(k).get("group") != WORKERS[1]
                       for k in m.get("coordd_faults_total", {}))
        code, body = fetch(c.url + "/readyz", 5)
        assert code == 503 and body.startswith(f"group {WORKERS[1]} failed at seq 12".encode())
        for step in range(13, 16):
            round_of(tp0, step)
        round_of(groups[ENGINE], 3, "state")

        # the failed group re-forms (a new epoch, the next seq); the others keep theirs
        for client in tp1:
            client.connect(timeout=10)
        assert tp1[0].epoch == epochs[WORKERS[1]] + 1
        round_of(tp1, 13)
        assert tp0[0].epoch == epochs[WORKERS[0]] and groups[ENGINE][0].epoch == epochs[ENGINE]
        assert fetch(c.url + "/readyz", 5) == (200, b"3/3 groups formed\n")

        m = samples(c.url)
        decided = {(dict(k)["group"], dict(k)["kind"]): v
                   for k, v in m["coordd_rounds_total"].items() if dict(k)["outcome"] == "decided"}
        assert decided == {(ENGINE, "state"): 4, (WORKERS[0], "forward"): 16,
                           (WORKERS[1], "forward"): 13}
        assert metric(m, "coordd_groups") == 3
        for name in GROUPS:
            assert metric(m, "coordd_registered_ranks", group=name) == dp
        assert metric(m, "coordd_registrations_total", group=WORKERS[1]) == 2 * dp

        doc = status(c.url)
        assert [g["name"] for g in doc["groups"]] == list(GROUPS)
        by_name = {g["name"]: g for g in doc["groups"]}
        assert {n: (g["state"], g["seq"], g["members"]) for n, g in by_name.items()} == {
            ENGINE: ("idle", 4, dp), WORKERS[0]: ("idle", 16, dp), WORKERS[1]: ("idle", 14, dp)
        }
        assert by_name[WORKERS[1]]["epoch"] == epochs[WORKERS[1]] + 1
        table = coordd_cli("status", "--url", c.url)
        assert table.returncode == 0, table.stderr
        for name in GROUPS:
            assert f"group {name}  dp {dp}  state idle" in table.stdout
        assert "ready: yes (3/3 groups formed)" in table.stdout
    finally:
        close(*groups.values())


def test_a_timeout_and_a_killed_rank_stay_in_their_group(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    """Each group's deadline and each rank's connection belong to its group alone: the timer
    follows the earliest deadline over the groups while the others' rounds open and close."""
    dp = 2
    c = serve(coordd, tmp_path, dp, "--step-timeout", "1.5", "--heartbeat-timeout", "2")
    slow, busy, engine = (join(c.address, name, dp) for name in (*WORKERS, ENGINE))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=hold_rank, args=(c.address, ENGINE, 1, dp, ready), daemon=True)
    try:
        engine[1].close()  # rank 1 of the engine cores moves to a process the test kills
        engine.pop()
        victim.start()
        assert ready.wait(60), "the engine-core rank process registered"
        began = time.monotonic()
        stuck = slow[0].start(report(0, 0))  # rank 1 of dp-tp0-pp0 never reports
        seq = 0
        while not stuck.done():  # meanwhile dp-tp1-pp0 decides round after round
            round_of(busy, seq)
            seq += 1
            assert time.monotonic() - began < 10, "the step timeout never fired"
        with pytest.raises(StepTimeout) as info:
            stuck.wait(timeout=1)
        assert info.value.ranks == (1,) and info.value.timeout == 1.5
        assert 1.4 <= time.monotonic() - began < 6
        assert seq >= 3, f"dp-tp1-pp0 kept deciding while dp-tp0-pp0 waited ({seq} rounds)"

        # the engine-core rank's process dies: its connection closes, coordd's socket monitor
        # tells that group alone
        pending = engine[0].start(report(0, 0), "state")
        os.kill(victim.pid or 0, signal.SIGKILL)
        with pytest.raises(RankLost) as lost:
            pending.wait(timeout=15)
        assert lost.value.ranks == (1,)
        for step in range(seq, seq + 3):
            round_of(busy, step)
        m = samples(c.url)
        assert metric(m, "coordd_faults_total", group=ENGINE, reason="lost") == 1
        assert metric(m, "coordd_faults_total", group=WORKERS[0], reason="timeout") == 1
        assert metric(m, "coordd_group_failed", group=WORKERS[1]) == 0
        assert metric(m, "coordd_rounds_total", group=WORKERS[1], kind="forward",
                      outcome="decided") == seq + 3
        assert metric(m, "coordd_disconnects_total") >= 1
    finally:
        if victim.is_alive():
            victim.kill()
        victim.join(timeout=10)
        close(slow, busy, engine)


def hold_rank(address: str, group: str, rank: int, dp: int,
              ready: multiprocessing.synchronize.Event) -> None:
    """A rank process: register, say so, stay registered until killed (at most a minute).
    (Nothing the test sets is waited on here: a process killed while waiting on a
    multiprocessing Event leaves the Event's set() hanging.)"""
    with CoordClient(address, dp_rank=rank, dp_size=dp, group=group,
                     config_fingerprint=f"fp-{group}") as client:
        client.connect(timeout=30)
        ready.set()
        time.sleep(60)


def test_max_groups_refuses_a_new_group_and_an_empty_group_gives_its_slot_up(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    c = serve(coordd, tmp_path, 2, env={"COORDD_MAX_GROUPS": "2", "COORDD_GROUPS": "[abc]"})
    a = join(c.address, "a", 2)
    b = [CoordClient(c.address, dp_rank=0, dp_size=2, group="b")]  # forming: 1 of 2 ranks
    b[0].connect(timeout=10)
    third = CoordClient(c.address, dp_rank=0, dp_size=2, group="c")
    try:
        with pytest.raises(Rejected) as info:
            third.connect(timeout=10)
        error = info.value
        assert (error.reason, error.expected, error.got) == (
            "group_limit", "at most 2 groups", "3 groups"
        )
        assert "--max-groups 2" in error.detail and "'c'" in error.detail
        assert "--max-groups" in error.hint
        # the groups in place go on
        round_of(a, 0)
        # every rank of group b leaves: b has no members, so a new group may take its slot
        close(b)
        wait_for(lambda: metric(samples(c.url), "coordd_registered_ranks", group="b") == 0,
                 15, "group b to empty")
        third.connect(timeout=10)
        m = samples(c.url)
        assert metric(m, "coordd_groups") == 2
        assert metric(m, "coordd_max_groups") == 2
        assert metric(m, "coordd_groups_dropped_total") == 1
        assert metric(m, "coordd_registrations_rejected_total", group="",
                      reason="group_limit") == 1
        assert {dict(k)["group"] for k in m["coordd_epoch"]} == {"a", "c"}
        doc = status(c.url)
        assert doc["coordd"]["max_groups"] == 2
        assert doc["outside_groups"] == {"rejected": {"group_limit": 1}, "faults": {},
                                         "groups_dropped": 1}
    finally:
        third.close()
        close(a, b)


def test_expect_groups_readiness(coordd: Callable[..., Coordd], tmp_path: Path) -> None:
    c = serve(coordd, tmp_path, 2, "--expect-groups", "2")
    assert fetch(c.url + "/readyz", 5) == (503, b"no group has registered yet\n")
    engine = join(c.address, ENGINE, 2)
    workers = [CoordClient(c.address, dp_rank=r, dp_size=2, group=WORKERS[0],
                           config_fingerprint="fp") for r in range(2)]
    try:
        workers[0].connect(timeout=10)
        assert fetch(c.url + "/readyz", 5) == (
            503, f"1/2 groups formed: group {WORKERS[0]} has 1/2 ranks registered\n".encode()
        )
        assert coordd_cli("status", "--url", c.url, "--probe", "readyz").returncode == 1
        workers[1].connect(timeout=10)
        assert fetch(c.url + "/readyz", 5) == (200, b"2/2 groups formed\n")
        assert coordd_cli("status", "--url", c.url, "--probe", "readyz").returncode == 0
        assert "expecting 2" in coordd_cli("status", "--url", c.url).stdout
    finally:
        close(engine, workers)
    bad = coordd_cli("serve", "--dp", "2", "--max-groups", "2", "--expect-groups", "3",
                     "--bind", f"ipc://{tmp_path}/other.sock")
    assert bad.returncode == 1 and "--expect-groups must be in 0..--max-groups" in bad.stderr


def test_expected_group_names_hold_against_junk_groups(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    """Issue 21: with `--expect-groups` names, junk groups a pattern admits fill the pattern
    slots but cannot take an expected group's slot, make /readyz ready, or hold it at 503."""
    c = serve(coordd, tmp_path, 2, "--max-groups", "2", "--expect-groups",
              f"{WORKERS[0]},{ENGINE}")
    junk = join(c.address, "dp-tp7-pp0", 2) + join(c.address, "dp-tp8-pp0", 2)
    real: list[CoordClient] = []
    try:
        code, body = fetch(c.url + "/readyz", 5)
        assert (code, body) == (
            503, f"0/2 expected groups formed: group {WORKERS[0]} has not registered\n".encode()
        ), "two formed junk groups do not make coordd ready"
        third = CoordClient(c.address, dp_rank=0, dp_size=2, group="dp-tp9-pp0")
        try:
            with pytest.raises(Rejected) as refused:
                third.connect(timeout=10)
            assert refused.value.reason == "group_limit", "the pattern slots are full"
        finally:
            third.close()
        real = join(c.address, WORKERS[0], 2) + join(c.address, ENGINE, 2)
        round_of(real[:2], 0)
        # a junk group fails (its ranks' kinds differ) with its ranks connected: nothing held
        # back
        pending = [junk[0].start(report(0, 0), "forward"), junk[1].start(report(1, 0), "draft")]
        for p in pending:
            with pytest.raises(StepMismatch):
                p.wait(timeout=15)
        assert fetch(c.url + "/readyz", 5) == (
            200, b"2/2 expected groups formed; 2 other group(s) not counted\n"
        )
        assert f"expecting {WORKERS[0]} {ENGINE}" in coordd_cli("status", "--url", c.url).stdout
    finally:
        close(junk, real)


def test_group_names_and_one_group_per_connection(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    c = serve(coordd, tmp_path, 2, "--groups", "[ab]")
    for name, problem in (("two words", "' '"), ("x" * 65, "65 characters"), ("", "0 char")):
        client = CoordClient(c.address, dp_rank=0, dp_size=2, group=name)
        try:
            with pytest.raises(Rejected) as info:
                client.connect(timeout=10)
        finally:
            client.close()
        assert info.value.reason == "group"
        assert info.value.detail.startswith("field group: ") and problem in info.value.detail
        assert info.value.expected == "1..64 printable characters, no whitespace"

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTING_ID, b"one-connection")
    sock.connect(c.address)

    def ask(message: object) -> object:
        sock.send(encode(message))
        assert sock.poll(10_000), "coordd answered"
        return decode_from_coordinator(sock.recv())

    try:
        hello = Hello(dp_size=2, dp_rank=0, config_fingerprint="", incarnation="i", group="a")
        welcome = ask(hello)
        assert isinstance(welcome, Welcome)
        refused = ask(Hello(dp_size=2, dp_rank=1, config_fingerprint="", incarnation="i",
                            group="b"))
        assert isinstance(refused, Reject) and refused.reason.value == "group"
        assert (refused.expected, refused.got) == ("a", "b")
        assert "registered as rank 0 of group 'a'" in refused.text
        # a report from a peer that registered with no group: coordd's own answer
        stranger = ctx.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.connect(c.address)
        try:
            for epoch, error in ((welcome.epoch, "protocol"), (1, "unavailable")):
                stranger.send(encode(StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0,
                                                epoch=epoch, seq=0)))
                assert stranger.poll(10_000)
                failed = decode_from_coordinator(stranger.recv())
                assert isinstance(failed, StepFailed) and failed.reason.value == error
        finally:
            stranger.close(0)
        m = samples(c.url)
        assert metric(m, "coordd_registrations_rejected_total", group="", reason="group") == 4
        assert metric(m, "coordd_faults_total", group="", reason="protocol") == 1
        assert metric(m, "coordd_faults_total", group="", reason="unavailable") == 1
        assert metric(m, "coordd_groups") == 1, "no refused Hello created a group"
    finally:
        sock.close(0)
        ctx.term()


def test_the_peer_map_stays_bounded_and_keeps_the_members(tmp_path: Path) -> None:
    """Hellos from many peers (each refused: the rank is taken) fill the peer -> group map; past
    its bound the peers that are no member are forgotten, and the members go on coordinating.
    (A `CoordServer` in this process, on its own event loop thread, to read its map.)"""
    server = CoordServer(ServerSettings(f"ipc://{tmp_path}/s.sock", dp_size=1, groups=("g",)))
    stop = threading.Event()
    serving = threading.Thread(target=run_server, args=(server, stop), daemon=True)
    serving.start()
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    member = CoordClient(server.bound_address, dp_rank=0, dp_size=1, group="g")
    try:
        member.connect(timeout=10)
        for n in range(300):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.ROUTING_ID, f"extra-{n}".encode())
            sock.connect(server.bound_address)
            socks.append(sock)
            sock.send(encode(Hello(dp_size=1, dp_rank=0, config_fingerprint="",
                                   incarnation=f"x{n}", group="g")))
        for sock in socks:
            assert sock.poll(10_000)
            answer = decode_from_coordinator(sock.recv())
            assert isinstance(answer, Reject) and answer.reason.value == "rank_taken"
        bound = sum(server.group_of(f"extra-{n}".encode()) is not None for n in range(300))
        assert bound == 0, f"{bound} refused peers still mapped (a refused peer is a stranger)"
        assert server.group_of(member.session.identity) is not None
        assert member.coordinate(report(0, 0), timeout=10).seq == 0
    finally:
        member.close()
        for sock in socks:
            sock.close(0)
        ctx.term()
        stop.set()
        serving.join(timeout=10)


def run_server(server: CoordServer, stop: threading.Event) -> None:
    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (stop.wait(30), loop.call_soon_threadsafe(done.set)),
                         daemon=True).start()
        await server.serve(done)

    asyncio.run(main())


def test_junk_members_of_pattern_groups_cannot_keep_an_expected_rank_out(
    coordd: Callable[..., Coordd], tmp_path: Path
) -> None:
    """Issue 28, defect 1, scaled down (the attack: --dp 16, 1008 junk members in 63
    pattern groups + the real group's 16 = the cap of 1024; every `enginecore` newcomer was
    the one connection shut, CoordinatorUnavailable after 10 s). Here --dp 2, 4 pattern groups
    of junk fill a cap of 8: an expected group's ranks still register (a junk member goes each
    time; the start-up warning that the cap leaves no room: tests/unit/test_options.py)."""
    c = serve(coordd, tmp_path, 2, "--max-groups", "4", "--max-connections", "8",
              "--expect-groups", ENGINE)
    junk = [client for n in range(4) for client in join(c.address, f"dp-tp{n}-pp0", 2)]
    engine: list[CoordClient] = []
    try:
        assert metric(samples(c.url), "coordd_connections_open") == 8
        began = time.monotonic()
        engine = join(c.address, ENGINE, 2)  # CoordinatorUnavailable after 10 s before
        assert time.monotonic() - began < 5
        assert fetch(c.url + "/readyz", 5)[0] == 200
        m = samples(c.url)
        assert metric(m, "coordd_registered_ranks", group=ENGINE) == 2
        assert metric(m, "coordd_connections_closed_total", reason="cap") == 2
    finally:
        close(junk, engine)
