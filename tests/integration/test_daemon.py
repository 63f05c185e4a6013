"""The daemon's contract with real sockets: registration, faults, shutdown, bad bytes, asyncio."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.synchronize
import os
import signal
import time
from collections.abc import Iterator

import pytest
import zmq

from coordd.client import AsyncCoordClient, CoordClient
from coordd.proto import (
    CoordinatorUnavailable,
    RankLost,
    Rejected,
    StepDecision,
    StepMismatch,
    StepReport,
    StepTimeout,
    decide,
)
from coordd.testing import CoorddProcess
from tests.integration.clients import CLIENT_KINDS, AnyClient, ClientMaker, client_maker

REPORT = StepReport(num_tokens=5, num_tokens_padded=8, want_ubatch=True, cudagraph_mode=2,
                    has_unfinished=True)


@pytest.fixture(params=CLIENT_KINDS)
def make_client(request: pytest.FixtureRequest) -> Iterator[ClientMaker]:
    """Each client-facing test runs with `CoordClient`, then with `AsyncCoordClient`."""
    yield from client_maker(request.param)


def clients(make: ClientMaker, address: str, dp: int, **kw: object) -> list[AnyClient]:
    out = [make(address, dp_rank=r, dp_size=dp, config_fingerprint="fp", **kw) for r in range(dp)]
    for c in out:
        c.connect(timeout=10)
    return out


def one_round(cs: list[AnyClient], reports: list[StepReport]) -> list[StepDecision]:
    pending = [c.start(r) for c, r in zip(cs, reports, strict=True)]
    return [p.wait(timeout=10) for p in pending]


def close_all(cs: list[AnyClient]) -> None:
    for c in cs:
        c.close()


def test_rounds_in_one_process_and_reregistration(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(3)
    cs = clients(make_client, coordd.address, 3)
    try:
        reports = [REPORT, StepReport(num_tokens=0, num_tokens_padded=0), REPORT]
        for _ in range(5):
            got = one_round(cs, reports)
            assert got[0] == got[1] == got[2]
            assert got[0] == decide(reports, epoch=got[0].epoch, seq=got[0].seq)
        assert [d.seq for d in got] == [4, 4, 4]
    finally:
        close_all(cs)


def test_registration_is_refused_with_both_values(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(2)
    first = make_client(coordd.address, dp_rank=0, dp_size=2, config_fingerprint="A")
    first.connect(timeout=10)
    bad = [
        (dict(dp_rank=1, dp_size=3, config_fingerprint="A"), "dp_size", "1..2", "3"),
        (dict(dp_rank=5, dp_size=2, config_fingerprint="A"), "rank_range", "0..1", "5"),
        (dict(dp_rank=1, dp_size=2, config_fingerprint="B"), "fingerprint", "A", "B"),
        (dict(dp_rank=1, dp_size=2, config_fingerprint="A", num_ubatches=3), "num_ubatches",
         "2", "3"),
        (dict(dp_rank=0, dp_size=2, config_fingerprint="A"), "rank_taken", None, None),
    ]
    try:
        for kwargs, reason, expected, got in bad:
            c = make_client(coordd.address, **kwargs)
            try:
                with pytest.raises(Rejected) as info:
                    c.connect(timeout=10)
            finally:
                c.close()
            assert info.value.reason == reason
            if expected is not None:
                assert (info.value.expected, info.value.got) == (expected, got)
    finally:
        first.close()


def test_env_vars_configure_the_daemon(tmp_path, make_client: ClientMaker) -> None:
    env = {"COORDD_DP": "3", "COORDD_STEP_TIMEOUT": "0.5", "COORDD_LOG_LEVEL": "warning"}
    with CoorddProcess(None, f"ipc://{tmp_path}/c.sock", env=env) as coordd:
        wrong = make_client(coordd.address, dp_rank=0, dp_size=4)  # over COORDD_DP
        with pytest.raises(Rejected) as info:
            wrong.connect(timeout=10)
        wrong.close()
        assert (info.value.reason, info.value.expected) == ("dp_size", "1..3")
        cs = clients(make_client, coordd.address, 3)
        try:
            with pytest.raises(StepTimeout) as timeout:
                cs[0].start(REPORT).wait(timeout=10)
            assert timeout.value.timeout == 0.5 and timeout.value.ranks == (1, 2)
        finally:
            close_all(cs)


def test_step_timeout_names_the_missing_rank(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(2, "ipc", "--step-timeout", "0.5")
    cs = clients(make_client, coordd.address, 2)
    try:
        t0 = time.monotonic()
        with pytest.raises(StepTimeout) as info:
            cs[0].start(REPORT).wait(timeout=10)
        assert info.value.ranks == (1,)
        assert time.monotonic() - t0 < 5
        # fail-stop: rank 1's late report gets the same failure at once
        with pytest.raises(StepTimeout) as late:
            cs[1].start(REPORT).wait(timeout=10)
        assert late.value == info.value
    finally:
        close_all(cs)


def test_mismatched_kind_fails_the_round_for_every_rank(start_coordd,
                                                        make_client: ClientMaker) -> None:
    coordd = start_coordd(2)
    cs = clients(make_client, coordd.address, 2)
    try:
        a = cs[0].start(REPORT, "draft")
        cs[0].ping()  # same connection, in order: coordd has rank 0's report before rank 1's
        b = cs[1].start(REPORT, "forward")
        errors = []
        for p in (a, b):
            with pytest.raises(StepMismatch) as info:
                p.wait(timeout=10)
            errors.append(info.value)
        assert errors[0] == errors[1]
        assert (errors[0].rank, errors[0].expected_kind, errors[0].got_kind) == (1, "draft",
                                                                                  "forward")
        # re-registering opens a new epoch and rounds resume, all ranks agreeing on the seq
        for c in cs:
            c.connect(timeout=10)
        got = one_round(cs, [REPORT, REPORT])
        assert got[0] == got[1] and got[0].seq == 1
    finally:
        close_all(cs)


def _register_then_idle(address: str, registered: mp.synchronize.Event) -> None:
    c = CoordClient(address, dp_rank=1, dp_size=2, config_fingerprint="fp")
    c.connect(timeout=10)
    registered.set()
    time.sleep(60)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_vanished_rank_is_lost_within_the_heartbeat_timeout(start_coordd, fault: str,
                                                              make_client: ClientMaker) -> None:
    """SIGKILL closes the connection at once; SIGSTOP freezes libzmq's I/O thread too, so the
    rank stops answering PINGs and coordd drops its connection after the heartbeat timeout."""
    coordd = start_coordd(2, "ipc", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1")
    ctx = mp.get_context("spawn")
    registered = ctx.Event()
    victim = ctx.Process(target=_register_then_idle, args=(coordd.address, registered),
                         daemon=True)
    victim.start()
    c = make_client(coordd.address, dp_rank=0, dp_size=2, config_fingerprint="fp")
    try:
        c.connect(timeout=10)
        assert registered.wait(timeout=30)
        pending = c.start(REPORT)
        os.kill(victim.pid, getattr(signal, fault))
        t0 = time.monotonic()
        with pytest.raises(RankLost) as info:
            pending.wait(timeout=10)
        assert info.value.ranks == (1,)
        assert time.monotonic() - t0 < 5
    finally:
        c.close()
        victim.kill()
        victim.join(timeout=5)


def test_sigterm_says_goodbye_and_exits_cleanly(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(2)
    cs = clients(make_client, coordd.address, 2)
    try:
        pending = cs[0].start(REPORT)
        coordd.signal(signal.SIGTERM)
        with pytest.raises(CoordinatorUnavailable, match="goodbye"):
            pending.wait(timeout=10)
        assert coordd.proc is not None and coordd.proc.wait(timeout=10) == 0
        with pytest.raises(CoordinatorUnavailable):
            cs[1].start(REPORT).wait(timeout=10)
    finally:
        close_all(cs)


def test_a_dropped_connection_fails_the_next_round_even_with_none_pending(
        start_coordd, make_client: ClientMaker) -> None:
    """One rule for both clients: coordd vanishes (no Goodbye) while no round is pending; the
    next round fails at once with the typed error, and so does every later one until connect()."""
    coordd = start_coordd(2)
    cs = clients(make_client, coordd.address, 2)
    try:
        one_round(cs, [REPORT, REPORT])
        coordd.signal(signal.SIGKILL)
        assert coordd.proc is not None
        coordd.proc.wait(timeout=10)
        time.sleep(0.3)  # the monitor has seen the disconnect; nobody has read it
        t0 = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match="dropped"):
            cs[0].start(REPORT).wait(timeout=10)
        with pytest.raises(CoordinatorUnavailable, match="dropped"):
            cs[0].start(REPORT).wait(timeout=10)
        assert time.monotonic() - t0 < 5
    finally:
        close_all(cs)


def test_connect_supersedes_a_pending_round(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(2)
    cs = clients(make_client, coordd.address, 2)
    try:
        stale = cs[0].start(REPORT)  # rank 1 never reports it
        for c in cs:
            c.connect(timeout=10)
        with pytest.raises(CoordinatorUnavailable, match="superseded by connect"):
            stale.wait(timeout=10)
        got = one_round(cs, [REPORT, REPORT])
        assert got[0] == got[1]
    finally:
        close_all(cs)


def test_bad_frames_are_dropped_and_rounds_go_on(start_coordd, make_client: ClientMaker) -> None:
    coordd = start_coordd(2)
    cs = clients(make_client, coordd.address, 2)
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(coordd.address)
    try:
        for frame in (b"", b"\xff\x00garbage", b"\x93\xa6report\x01", [b"a", b"b", b"c"]):
            if isinstance(frame, list):
                rogue.send_multipart(frame)
            else:
                rogue.send(frame)
        for _ in range(3):
            got = one_round(cs, [REPORT, REPORT])
            assert got[0] == got[1]
    finally:
        rogue.close()
        close_all(cs)


def test_async_and_sync_clients_share_rounds(start_coordd) -> None:
    coordd = start_coordd(2)
    sync = CoordClient(coordd.address, dp_rank=1, dp_size=2, config_fingerprint="fp")

    async def main() -> list[StepDecision]:
        async with AsyncCoordClient(coordd.address, dp_rank=0, dp_size=2,
                                    config_fingerprint="fp") as a:
            await a.connect(timeout=10)
            sync.connect(timeout=10)
            out = []
            for _ in range(20):
                future = a.start(REPORT, "forward")
                mine = sync.start(REPORT, "forward")
                theirs = mine.wait(timeout=10)
                out.append(await asyncio.wait_for(future, 10))
                assert out[-1] == theirs
            assert await a.ping() > 0
            return out

    try:
        decisions = asyncio.run(main())
        assert [d.seq for d in decisions] == list(range(20))
    finally:
        sync.close()
