"""A real root coordd, real relay processes (`coordd serve --relay-to`) and real clients over
ipc://: ranks through relays get the flat policy's decisions, and every fault names the same
culprit at every rank (a rank lost, a relay lost, the root restarted)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.proto.errors import CoordError, CoordinatorUnavailable, RankLost, Rejected
from coordd.proto.messages import StepDecision
from coordd.proto.policy import decide
from coordd.testing import CoorddProcess
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from tests.integration.scrape import free_port

DP = 4
LAYOUT = {0: "0-1", 1: "2-3"}  # relay -> its ranks


class TreeProcs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root_address = f"ipc://{tmp}/root.sock"
        self.root: CoorddProcess | None = None
        self.relays: dict[int, CoorddProcess] = {}
        self.started: list[CoorddProcess] = []
        self.port = 0

    def start_root(self, *args: str) -> CoorddProcess:
        self.root = CoorddProcess(
            DP, self.root_address, ["--log-level", "warning", "--relay-root", *args]
        )
        self.started.append(self.root)
        return self.root.start()

    def start_relay(self, index: int, ranks: str | None = None) -> CoorddProcess:
        proc = CoorddProcess(
            DP,
            f"ipc://{self.tmp}/relay{index}.sock",
            ["--log-level", "warning", "--relay-to", self.root_address,
             "--relay-ranks", ranks or LAYOUT[index], "--relay-name", f"node{index}",
             "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1"],
        )
        self.relays[index] = proc
        self.started.append(proc)
        return proc.start()

    def address_of(self, rank: int) -> str:
        return self.relays[rank // 2].address


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[TreeProcs]:
    procs = TreeProcs(tmp_path)
    procs.port = free_port()
    procs.start_root("--step-timeout", "3", "--metrics-port", str(procs.port))
    procs.start_relay(0)
    procs.start_relay(1)
    yield procs
    for proc in procs.started:
        proc.stop()


def readyz(port: int) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


def clients(tree: TreeProcs) -> list[CoordClient]:
    return [
        CoordClient(tree.address_of(r), dp_rank=r, dp_size=DP, config_fingerprint="it")
        for r in range(DP)
    ]


def on_every_rank(ranks: list[int], work: Callable[[int], object]) -> dict[int, object]:
    """Run `work(rank)` on a thread per rank; every thread is joined (with a deadline)."""
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except Exception as exc:  # the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def connect_all(cs: list[CoordClient]) -> list[int]:
    welcomes = on_every_rank(list(range(DP)), lambda r: cs[r].connect(timeout=10))
    for w in welcomes.values():
        assert not isinstance(w, Exception), w
    seqs = {w.next_seq for w in welcomes.values()}  # type: ignore[attr-defined]
    epochs = {w.epoch for w in welcomes.values()}  # type: ignore[attr-defined]
    assert len(seqs) == 1 and len(epochs) == 1, welcomes
    return [seqs.pop(), epochs.pop()]


@pytest.mark.timeout(90)
def test_ranks_through_relays_get_the_flat_policys_decisions(tree: TreeProcs) -> None:
    cs = clients(tree)
    assert readyz(tree.port) == (503, "no group has registered yet")
    try:
        first, epoch = connect_all(cs)
        # the root's /readyz counts a group served through relays as it counts a flat one
        assert readyz(tree.port) == (200, "1/1 groups formed (default: 4/4 ranks registered)")
        rounds = 80

        def steps(rank: int) -> list[StepDecision]:
            out = []
            for seq in range(first, first + rounds):
                out.append(cs[rank].start(report_for(5, rank, seq), kind_for(5, seq)).wait(10))
            return out

        results = on_every_rank(list(range(DP)), steps)
        for r in range(DP):
            assert not isinstance(results[r], Exception), results[r]
        for i, seq in enumerate(range(first, first + rounds)):
            got = [results[r][i] for r in range(DP)]  # type: ignore[index]
            expected = decide(
                [report_for(5, r, seq) for r in range(DP)], epoch=epoch, seq=seq,
                kind=kind_for(5, seq),
            )
            assert all(d == expected for d in got), (seq, got[0], expected)
        gathered = on_every_rank(
            list(range(DP)), lambda r: cs[r].gather("site", [r, r * 10])
        )
        assert all(g == [[r, r * 10] for r in range(DP)] for g in gathered.values()), gathered
    finally:
        for c in cs:
            c.close()


@pytest.mark.timeout(90)
def test_a_rank_lost_under_a_relay_is_named_at_every_rank(tree: TreeProcs) -> None:
    cs = clients(tree)
    try:
        first, _ = connect_all(cs)
        cs[3].close(goodbye=False)

        def step(rank: int) -> object:
            return cs[rank].start(report_for(1, rank, first), kind_for(1, first)).wait(10)

        results = on_every_rank([0, 1, 2], step)
        for r in (0, 1, 2):
            error = results[r]
            assert isinstance(error, RankLost), (r, error)
            assert list(error.ranks) == [3], error
    finally:
        for c in cs:
            c.close()


@pytest.mark.timeout(90)
def test_a_relay_killed_is_rank_lost_naming_all_its_ranks(tree: TreeProcs) -> None:
    cs = clients(tree)
    try:
        first, _ = connect_all(cs)
        relay = tree.relays[1]
        assert relay.proc is not None
        os.kill(relay.proc.pid, signal.SIGKILL)
        relay.proc.wait(timeout=10)

        def step(rank: int) -> object:
            return cs[rank].start(report_for(1, rank, first), kind_for(1, first)).wait(10)

        results = on_every_rank([0, 1], step)
        for r in (0, 1):
            error = results[r]
            assert isinstance(error, RankLost), (r, error)
            assert list(error.ranks) == [2, 3], error
    finally:
        for c in cs:
            c.close(goodbye=False)


@pytest.mark.timeout(120)
def test_the_root_restarted_is_unavailable_everywhere_and_the_relays_register_again(
    tree: TreeProcs,
) -> None:
    cs = clients(tree)
    try:
        first, epoch = connect_all(cs)
        done = on_every_rank(
            list(range(DP)),
            lambda r: cs[r].start(report_for(2, r, first), kind_for(2, first)).wait(10),
        )
        assert all(isinstance(d, StepDecision) for d in done.values()), done
        assert tree.root is not None
        tree.root.stop()
        tree.start_root("--step-timeout", "3")

        def step_after(rank: int) -> object:
            try:
                pending = cs[rank].start(report_for(2, rank, first + 1), kind_for(2, first + 1))
                return pending.wait(10)
            except CoordError as exc:
                return exc

        results = on_every_rank(list(range(DP)), step_after)
        for r in range(DP):
            assert isinstance(results[r], CoordinatorUnavailable), (r, results[r])
        again, new_epoch = connect_all(cs)
        assert new_epoch != epoch
        done = on_every_rank(
            list(range(DP)),
            lambda r: cs[r].start(report_for(2, r, again), kind_for(2, again)).wait(10),
        )
        expected = decide([report_for(2, r, again) for r in range(DP)], epoch=new_epoch,
                          seq=again, kind=kind_for(2, again))
        assert all(d == expected for d in done.values()), done
    finally:
        for c in cs:
            c.close()


@pytest.mark.timeout(60)
def test_a_relay_cannot_claim_another_nodes_ranks(tree: TreeProcs) -> None:
    thief = tree.start_relay(2, ranks="1-2")
    cs = clients(tree)
    intruder = CoordClient(thief.address, dp_rank=1, dp_size=DP, config_fingerprint="it")
    try:
        connect_all(cs)
        with pytest.raises(Rejected) as refused:
            intruder.connect(timeout=10)
        assert refused.value.reason == "rank_taken"
        assert "node2" in str(refused.value) and "node0" in str(refused.value)
        direct = CoordClient(tree.root_address, dp_rank=0, dp_size=DP, config_fingerprint="it")
        try:
            with pytest.raises(Rejected) as flat:
                direct.connect(timeout=10)
            assert "relays" in str(flat.value)
        finally:
            direct.close()
    finally:
        intruder.close()
        for c in cs:
            c.close()


@pytest.mark.timeout(90)
def test_relays_authenticate_with_curve_and_speak_only_for_their_bound_ranks(
    tmp_path: Path,
) -> None:
    """The root over tcp with CURVE: each relay's key is bound to its node's ranks; a relay
    with node 0's key that claims ranks 2-3 is refused (`curve_key`, naming it and the
    ranks), and the honest relays' ranks decide as ever."""
    import subprocess
    import sys

    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "coordd", "keygen", "--dir", str(keys), "coordd", "node0", "node1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    grants = [f"0-1={keys}/node0.key", f"2-3={keys}/node1.key"]  # a node's ranks, as a range
    root = CoorddProcess(
        DP,
        "tcp://127.0.0.1:*",
        ["--log-level", "warning", "--curve-secret-key", f"{keys}/coordd.key_secret",
         "--curve-client-keys", ",".join(grants)],
        env={"COORDD_RELAY_ROOT": "1"},  # a root: CURVE keys alone take no relays
    )
    started = [root.start()]

    def relay(index: int, ranks: str, key: str) -> CoorddProcess:
        proc = CoorddProcess(
            DP,
            f"ipc://{tmp_path}/relay{index}.sock",
            ["--log-level", "warning", "--relay-to", root.address, "--relay-ranks", ranks,
             "--relay-name", f"node{index}", "--relay-curve-server-key", f"{keys}/coordd.key",
             "--relay-curve-key", f"{keys}/{key}.key_secret"],
        )
        started.append(proc)
        return proc.start()

    try:
        relays = [relay(0, "0-1", "node0"), relay(1, "2-3", "node1")]
        thief = relay(2, "2-3", "node0")
        intruder = CoordClient(thief.address, dp_rank=2, dp_size=DP, config_fingerprint="it")
        try:
            with pytest.raises(Rejected) as refused:
                intruder.connect(timeout=10)
        finally:
            intruder.close()
        assert refused.value.reason == "curve_key", refused.value
        assert "node2" in str(refused.value) and "[2, 3]" in str(refused.value)
        cs = [
            CoordClient(relays[r // 2].address, dp_rank=r, dp_size=DP, config_fingerprint="it")
            for r in range(DP)
        ]
        try:
            first, epoch = connect_all(cs)
            done = on_every_rank(
                list(range(DP)),
                lambda r: cs[r].start(report_for(3, r, first), kind_for(3, first)).wait(10),
            )
            expected = decide([report_for(3, r, first) for r in range(DP)], epoch=epoch,
                              seq=first, kind=kind_for(3, first))
            assert all(d == expected for d in done.values()), done
        finally:
            for c in cs:
                c.close()
    finally:
        for proc in started:
            proc.stop()


@pytest.mark.timeout(60)
def test_a_relay_pointed_at_a_coordd_that_is_no_root_says_so(tmp_path: Path) -> None:
    """Issue 36 item 1: every coordd answered the relay wire. A coordd started without
    --relay-root refuses the relay's registration (`not_root`, naming the option); the relay's
    ranks get that Rejected, and the relay's log says the coordd it points at is no root.
    The same coordd still serves ranks that connect to it."""
    flat = CoorddProcess(DP, f"ipc://{tmp_path}/flat.sock", ["--log-level", "warning"]).start()
    log = tmp_path / "relay.log"
    relay = CoorddProcess(
        DP,
        f"ipc://{tmp_path}/relay.sock",
        ["--log-level", "warning", "--relay-to", flat.address, "--relay-ranks", "0-1",
         "--relay-name", "node0"],
        log=log,
    )
    try:
        relay.start()
        rank = CoordClient(relay.address, dp_rank=0, dp_size=DP, config_fingerprint="it")
        try:
            with pytest.raises(Rejected) as refused:
                rank.connect(timeout=10)
        finally:
            rank.close()
        assert refused.value.reason == "not_root", refused.value
        assert "--relay-root" in str(refused.value) and "--relay-root" in refused.value.hint
        text = log.read_text()
        assert "is not started as a root" in text and flat.address in text, text
        direct = CoordClient(flat.address, dp_rank=0, dp_size=1, config_fingerprint="it")
        try:
            assert direct.connect(timeout=10).dp_size == 1
        finally:
            direct.close()
    finally:
        relay.stop()
        flat.stop()


@pytest.mark.timeout(90)
def test_a_relay_says_the_coordd_is_no_root_once_per_connection(tmp_path: Path) -> None:
    """The relay's line about a coordd that is no root comes once per connection to it (a
    rank retrying does not repeat it), and again once the relay connects anew."""
    import time

    address = f"ipc://{tmp_path}/flat.sock"
    flat = CoorddProcess(DP, address, ["--log-level", "warning"]).start()
    log = tmp_path / "relay.log"
    relay = CoorddProcess(
        DP,
        f"ipc://{tmp_path}/relay.sock",
        ["--log-level", "warning", "--relay-to", address, "--relay-ranks", "0-1",
         "--relay-name", "node0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1"],
        log=log,
    )

    def refused(rank: int) -> None:
        deadline = time.monotonic() + 20
        while True:
            c = CoordClient(relay.address, dp_rank=rank, dp_size=DP, config_fingerprint="it")
            try:
                c.connect(timeout=5)
            except Rejected as exc:
                assert exc.reason == "not_root", exc
                return
            except CoordinatorUnavailable:
                assert time.monotonic() < deadline, "the relay never reached the coordd again"
                time.sleep(0.2)
            finally:
                c.close()

    def lines() -> int:
        return log.read_text().count("is not started as a root")

    try:
        relay.start()
        refused(0)
        refused(1)
        assert lines() == 1
        flat.stop()
        flat = CoorddProcess(DP, address, ["--log-level", "warning"]).start()
        refused(0)
        assert lines() == 2, log.read_text()
    finally:
        relay.stop()
        flat.stop()
