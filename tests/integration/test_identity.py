"""A rank is its registered connection: a real coordd, real clients, a rogue DEALER.

The attack of issue 11: a peer that never sent a Hello presents a registered rank's routing id
(learnt from a Reject, /status, or guessed from `<rank>:<incarnation>`). With ROUTER_HANDOVER on
it took the id over: it received the rank's decisions and its forged reports counted as the
rank's, the real rank was orphaned. Now libzmq drops the second connection, the rank's rounds go
on with its own reports, and nothing that identifies a connection is echoed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from coordd.client._transport import CurveKeys
from coordd.client.sync import CoordClient
from coordd.proto import Rejected, StepReport
from coordd.proto.messages import StepKind, encode
from coordd.proto.policy import decide
from tests.integration.test_operability import (  # noqa: F401 - the fixture
    Coordd,
    coordd,
    coordd_cli,
    metric,
    samples,
    status,
)

pytestmark = pytest.mark.timeout(120)

HONEST = [StepReport(num_tokens=8 + r, num_tokens_padded=8 + r) for r in range(2)]
FORGED = StepReport(num_tokens=4000, num_tokens_padded=4000, has_unfinished=True)


def rogue_takes(address: str, victim: CoordClient, curve: CurveKeys | None) -> zmq.Socket:
    """A DEALER presenting the victim's routing id (the worst case: the id leaked), which
    sends a forged report for the victim's rank and next seq."""
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.ROUTING_ID, victim.session.identity)
    rogue.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        rogue.curve_serverkey = curve.server_public
        rogue.curve_publickey = curve.public
        rogue.curve_secretkey = curve.secret
    rogue.connect(address)
    forged = victim.session.stamp(FORGED, StepKind.FORWARD)
    deadline = time.monotonic() + 5
    while not rogue.poll(50, zmq.POLLOUT) and time.monotonic() < deadline:
        pass
    rogue.send(encode(forged), zmq.NOBLOCK)
    time.sleep(0.3)  # the forged report reaches coordd before the honest ones
    return rogue


def run_attack(c: Coordd, curve: CurveKeys | None, log: Path) -> None:
    ranks = [CoordClient(c.address, dp_rank=r, dp_size=2, config_fingerprint="fp", curve=curve)
             for r in range(2)]
    rogue = None
    try:
        for r in ranks:
            r.connect(timeout=10)
        rogue = rogue_takes(c.address, ranks[0], curve)
        for seq in range(3):
            pending = [r.start(HONEST[i]) for i, r in enumerate(ranks)]
            decisions = [p.wait(timeout=10) for p in pending]
            epoch = decisions[0].epoch
            want = decide([r.session.stamp(HONEST[i], StepKind.FORWARD, seq=seq)
                           for i, r in enumerate(ranks)], epoch=epoch, seq=seq)
            assert decisions == [want, want], "a forged report counted for rank 0"
        assert not rogue.poll(500), "the rogue received the rank's decisions"

        # A second client asks for rank 0: refused, and the Reject names nothing of the holder.
        with CoordClient(c.address, dp_rank=0, dp_size=2, config_fingerprint="fp",
                         curve=curve) as impostor, pytest.raises(Rejected) as info:
            impostor.connect(timeout=10)
        error = info.value
        assert error.reason == "rank_taken"
        said = f"{error} {error.expected} {error.got}"
        for r in ranks:
            assert r.session.identity.decode() not in said
            assert r.session.hello_message.incarnation not in said
    finally:
        if rogue is not None:
            rogue.close()
        for r in ranks:
            r.close()

    m = samples(c.url)
    assert metric(m, "coordd_rank_takeovers_refused_total", group="default",
                  kind="rank_held") >= 1
    doc = json.dumps(status(c.url))
    text = log.read_text()
    for r in ranks:
        ident = r.session.identity.decode()
        assert ident not in doc, "/status shows a routing id"
        assert ident not in text, "the log shows a routing id"
    lines = [json.loads(line) for line in text.splitlines()]
    (refusal, *_) = [r for r in lines if r["message"] == "rank takeover refused"]
    assert refusal["kind"] == "rank_held" and refusal["rank"] == 0
    assert refusal["address"] not in ("", "-"), "the refusal names the peer's address"


def test_ipc_a_live_ranks_routing_id_cannot_be_taken_over(coordd: Callable[..., Coordd],  # noqa: F811
                                                          tmp_path: Path) -> None:
    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", "--metrics-port", "0",
               "--log-format", "json", stderr=log)
    run_attack(c, None, log)


def test_tcp_curve_with_a_shared_key_a_live_ranks_routing_id_cannot_be_taken_over(
        coordd: Callable[..., Coordd], tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    assert coordd_cli("keygen", "--dir", str(keys), "coordd", "rank").returncode == 0
    monkeypatch.delenv("COORDD_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("COORDD_CURVE_CLIENT_KEY", raising=False)
    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "2", "--bind", "tcp://127.0.0.1:*",
               "--curve-secret-key", str(keys / "coordd.key_secret"),
               "--curve-client-keys", str(keys / "rank.key"), "--metrics-port", "0",
               "--log-format", "json", stderr=log)
    # every rank and the rogue hold the one shared key, as the deploy files do
    shared = CurveKeys.from_files(str(keys / "coordd.key"), str(keys / "rank.key_secret"))
    run_attack(c, shared, log)


def test_a_report_over_another_connection_is_not_counted(coordd: Callable[..., Coordd],  # noqa: F811
                                                         tmp_path: Path) -> None:
    """Every message from a routing id must come over the connection its Hello came in on: a
    report that names the rank's routing id over another live connection is refused."""
    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "2", "--bind", f"ipc://{tmp_path}/c.sock", "--metrics-port", "0",
               "--log-format", "json", stderr=log)
    ranks = [CoordClient(c.address, dp_rank=r, dp_size=2, config_fingerprint="fp")
             for r in range(2)]
    try:
        for r in ranks:
            r.connect(timeout=10)
        decisions = [p.wait(timeout=10) for p in [r.start(HONEST[i]) for i, r in
                                                   enumerate(ranks)]]
        assert decisions[0] == decisions[1]
        # The rogue's frames never reach coordd (libzmq drops the duplicate id): the group
        # keeps working and its registered connections are untouched.
        rogue = rogue_takes(c.address, ranks[1], None)
        rogue.close()
        decisions = [p.wait(timeout=10) for p in [r.start(HONEST[i]) for i, r in
                                                   enumerate(ranks)]]
        assert decisions[0] == decisions[1] and decisions[0].seq == 1
        assert decisions[0].num_tokens_across_dp == [8, 9]
    finally:
        for r in ranks:
            r.close()


def test_curve_keys_bound_to_ranks(coordd: Callable[..., Coordd], tmp_path: Path,  # noqa: F811
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One key per rank (`rank<N>.key`, or `N=PATH`): a leaked rank key cannot speak for
    another rank; a shared key (any other name) still admits any rank."""
    keys = tmp_path / "keys"
    made = coordd_cli("keygen", "--dir", str(keys), "coordd", "rank0", "node-b", "shared")
    assert made.returncode == 0, made.stderr
    monkeypatch.delenv("COORDD_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("COORDD_CURVE_CLIENT_KEY", raising=False)
    log = tmp_path / "coordd.log"
    c = coordd("serve", "--dp", "3", "--bind", "tcp://127.0.0.1:*",
               "--curve-secret-key", str(keys / "coordd.key_secret"),
               "--curve-client-keys",
               f"{keys / 'rank0.key'},1={keys / 'node-b.key'},{keys / 'shared.key'}",
               "--metrics-port", "0", "--log-format", "json", stderr=log)

    def key(name: str) -> CurveKeys:
        return CurveKeys.from_files(str(keys / "coordd.key"), str(keys / f"{name}.key_secret"))

    def client(rank: int, name: str) -> CoordClient:
        return CoordClient(c.address, dp_rank=rank, dp_size=3, config_fingerprint="fp",
                           curve=key(name))

    for rank, name in ((1, "rank0"), (2, "rank0"), (0, "node-b"), (2, "node-b")):
        with client(rank, name) as leaked, pytest.raises(Rejected) as info:
            leaked.connect(timeout=10)
        assert info.value.reason == "curve_key", info.value
        assert f"dp_rank {rank}" in str(info.value)
    ranks = [client(0, "rank0"), client(1, "node-b"), client(2, "shared")]
    try:
        for r in ranks:
            r.connect(timeout=10)
        decisions = [p.wait(timeout=10) for p in [r.start(HONEST[0]) for r in ranks]]
        assert len({d.seq for d in decisions}) == 1
    finally:
        for r in ranks:
            r.close()
    m = samples(c.url)
    # refused before their group existed: counted outside any group (a group per name
    # would be a series per name, issue 21)
    assert metric(m, "coordd_rank_takeovers_refused_total", group="-",
                  kind="key_bound") == 4
    assert metric(m, "coordd_registrations_total", group="default") == 3


def test_curve_keys_bound_to_groups(coordd: Callable[..., Coordd], tmp_path: Path,  # noqa: F811
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21: a leaked key of rank 1 of dp-tp0-pp0 (`1@dp-tp0-pp0=PATH`) registers there
    only: Hellos under 8 new names a pattern admits create no group (before: 64 of 64)."""
    keys = tmp_path / "keys"
    made = coordd_cli("keygen", "--dir", str(keys), "coordd", "r0", "r1")
    assert made.returncode == 0, made.stderr
    monkeypatch.delenv("COORDD_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("COORDD_CURVE_CLIENT_KEY", raising=False)
    c = coordd("serve", "--dp", "2", "--bind", "tcp://127.0.0.1:*",
               "--curve-secret-key", str(keys / "coordd.key_secret"),
               "--curve-client-keys",
               f"0@dp-tp0-pp0={keys / 'r0.key'},1@dp-tp0-pp0={keys / 'r1.key'}",
               "--metrics-port", "0", stderr=tmp_path / "coordd.log")

    def client(rank: int, group: str) -> CoordClient:
        curve = CurveKeys.from_files(str(keys / "coordd.key"), str(keys / f"r{rank}.key_secret"))
        return CoordClient(c.address, dp_rank=rank, dp_size=2, config_fingerprint="fp",
                           group=group, curve=curve)

    for t in range(1, 9):
        with client(1, f"dp-tp{t}-pp0") as leaked, pytest.raises(Rejected) as info:
            leaked.connect(timeout=10)
        assert info.value.reason == "curve_key", info.value
        assert info.value.detail.endswith(
            "its CURVE key (r1.key) is bound to dp_rank 1 of group dp-tp0-pp0"), info.value
    ranks = [client(0, "dp-tp0-pp0"), client(1, "dp-tp0-pp0")]
    try:
        for r in ranks:
            r.connect(timeout=10)
        decisions = [p.wait(timeout=10) for p in [r.start(HONEST[0]) for r in ranks]]
        assert len({d.seq for d in decisions}) == 1
    finally:
        for r in ranks:
            r.close()
    doc = status(c.url)
    assert [g["name"] for g in doc["groups"]] == ["dp-tp0-pp0"], "no junk group was created"
    assert metric(samples(c.url), "coordd_rank_takeovers_refused_total", group="-",
                  kind="key_bound") == 8
