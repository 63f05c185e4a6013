"""A rank is the connection that registered it: the coordinator's side (sans-IO, fake clock).

After a failure the next Hello passes the same checks as the first registration: the failed
epoch's ranks whose connections are still open keep their ranks and bind the group's settings
until they register again or leave, so a stranger's Hello can neither re-form the group with
other settings nor take an honest rank (today's code let any Hello re-form the group and locked
the honest ranks out with rank_taken / fingerprint Rejects).
"""

from __future__ import annotations

import pytest

from coordd.proto import (
    Coordinator,
    Hello,
    Reject,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
)
from coordd.proto.group_state import GroupState

DP = 3
EPOCH = 11


def peer(rank: int) -> bytes:
    return f"honest{rank}".encode()


def hello(rank: int, fingerprint: str = "fp", **kw: object) -> Hello:
    return Hello(dp_size=DP, dp_rank=rank, config_fingerprint=fingerprint,
                 incarnation=f"inc{rank}", **kw)  # type: ignore[arg-type]


def report(rank: int, seq: int, epoch: int = EPOCH, tokens: int = 4) -> StepReport:
    return StepReport(num_tokens=tokens, num_tokens_padded=max(tokens, 0), dp_rank=rank,
                      epoch=epoch, seq=seq, kind=StepKind.FORWARD)


def failed_group() -> Coordinator:
    """Every rank registered, then rank 2 sent an invalid report: the group is FAILED and every
    honest connection is still open."""
    c = Coordinator(DP, epoch=EPOCH, step_timeout=10.0)
    for r in range(DP):
        (_, welcome), = c.receive(peer(r), hello(r), 0.0)
        assert isinstance(welcome, Welcome)
    c.receive(peer(0), report(0, 0), 1.0)
    (_, failure), = c.receive(peer(2), report(2, 0, tokens=-1), 1.0)
    assert isinstance(failure, StepFailed) and c.state is GroupState.FAILED
    return c


def answer(c: Coordinator, who: bytes, message: Hello) -> object:
    (to, msg), = c.receive(who, message, 2.0)
    assert to == (who,)
    return msg


def test_a_strangers_hello_after_a_failure_cannot_change_the_fingerprint() -> None:
    c = failed_group()
    msg = answer(c, b"stranger", hello(1, "evil"))
    assert isinstance(msg, Reject) and msg.reason is RejectReason.RANK_TAKEN
    assert c.snapshot().epoch == EPOCH, "a refused Hello opened no epoch"
    # every honest rank registers again: a new epoch, the same settings
    for r in range(DP):
        assert isinstance(answer(c, peer(r), hello(r)), Welcome)
    assert c.snapshot().epoch == EPOCH + 1


def test_a_strangers_hello_for_a_free_rank_with_another_fingerprint_is_refused() -> None:
    c = failed_group()
    c.peer_lost(peer(2), 2.0)  # rank 2's process died: its rank is free
    msg = answer(c, b"stranger", hello(2, "evil"))
    assert isinstance(msg, Reject) and msg.reason is RejectReason.FINGERPRINT
    assert msg.expected == "fp" and msg.got == "evil"
    assert c.snapshot().epoch == EPOCH


def test_a_strangers_hello_cannot_take_a_rank_whose_connection_is_live() -> None:
    """Rank 1 re-registers first; the stranger then claims rank 0, whose old connection is
    still open (it has not re-registered yet): refused, and rank 0 gets its rank back."""
    c = failed_group()
    assert isinstance(answer(c, peer(1), hello(1)), Welcome)
    msg = answer(c, b"stranger", hello(0))
    assert isinstance(msg, Reject) and msg.reason is RejectReason.RANK_TAKEN
    assert "inc0" not in f"{msg.text}{msg.expected}{msg.got}"
    msg = answer(c, b"stranger", hello(2, "evil"))
    assert isinstance(msg, Reject) and msg.reason is RejectReason.RANK_TAKEN
    for r in (0, 2):
        assert isinstance(answer(c, peer(r), hello(r)), Welcome)
    epoch = c.snapshot().epoch
    seq = c.snapshot().seq
    sends = []
    for r in range(DP):
        sends.extend(c.receive(peer(r), report(r, seq, epoch), 3.0))
    (to, decision), = sends
    assert isinstance(decision, StepDecision) and set(to) == {peer(r) for r in range(DP)}


def test_a_held_rank_is_freed_when_its_connection_closes() -> None:
    c = failed_group()
    assert isinstance(answer(c, peer(1), hello(1)), Welcome)
    assert isinstance(answer(c, b"stranger", hello(0)), Reject)
    c.peer_lost(peer(0), 3.0)  # rank 0's old connection closes
    assert isinstance(answer(c, b"newzero", hello(0)), Welcome)
    assert b"newzero" in c.holders() and peer(0) not in c.holders()


def test_a_held_rank_binds_through_a_second_failure() -> None:
    c = failed_group()
    assert isinstance(answer(c, peer(1), hello(1)), Welcome)
    # the new epoch fails too (rank 1 skips a seq) while ranks 0 and 2 still hold
    seq = c.snapshot().seq
    c.receive(peer(1), report(1, seq + 1, EPOCH + 1), 3.0)
    assert c.state is GroupState.FAILED
    for r in (0, 2):
        msg = answer(c, b"stranger", hello(r))
        assert isinstance(msg, Reject) and msg.reason is RejectReason.RANK_TAKEN
    msg = answer(c, b"stranger2", hello(1, "evil"))
    assert isinstance(msg, Reject)
    assert set(c.holders()) == {peer(r) for r in range(DP)}


def test_once_no_connection_holds_a_rank_new_settings_are_accepted() -> None:
    """The documented way to change the fingerprint: stop every rank (or restart coordd)."""
    c = failed_group()
    for r in range(DP):
        c.peer_lost(peer(r), 2.0)
    assert c.holders() == []
    assert isinstance(answer(c, b"v2-0", hello(0, "v2")), Welcome)
    msg = answer(c, b"v1-1", hello(1, "fp"))
    assert isinstance(msg, Reject) and msg.reason is RejectReason.FINGERPRINT


def test_curve_keys_bound_to_ranks_by_file_name_or_entry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from coordd.core._grants import ANY, Grant
    from coordd.io._curve import CurveGate, load_client_keys, load_grants, write_keypair
    from coordd.proto.keyfile import read_key_file

    for name in ("rank3", "rank", "node", "both"):
        write_keypair(str(tmp_path), name)

    def pub(name: str) -> bytes:
        return read_key_file(str(tmp_path / f"{name}.key"))[0]

    entries = [str(tmp_path / "rank3.key"), str(tmp_path / "rank.key"),
               f"5={tmp_path / 'node.key'}", f"6={tmp_path / 'both.key'}",
               str(tmp_path / "both.key")]
    grants = load_grants(entries)
    assert grants == {pub("rank3"): {Grant(rank=3)}, pub("rank"): {ANY},
                      pub("node"): {Grant(rank=5)}, pub("both"): {Grant(rank=6), ANY}}
    assert set(load_client_keys(entries)) == set(grants)
    gate = CurveGate(b"", b"", load_client_keys(entries), grants=grants)
    assert gate.binds
    assert gate.key_refusal(pub("rank3").decode(), "g", 3) is None
    assert gate.key_refusal(pub("rank3").decode(), "g", 4) == (
        "its CURVE key (rank3.key) is bound to dp_rank 3"
    )
    assert gate.key_refusal(pub("rank").decode(), "g", 7) is None
    assert gate.key_refusal(pub("both").decode(), "g", 1) is None


def test_curve_keys_bound_to_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 21: a leaked key of one group's rank cannot create groups, nor register in
    another group: `@GROUP=PATH` and `N@GROUP=PATH` (GROUP a name or pattern)."""
    from coordd.core._grants import Grant, split_entry
    from coordd.io._curve import CurveGate, load_client_keys, load_grants, write_keypair
    from coordd.proto.keyfile import read_key_file

    (tmp_path / "tp0").mkdir()
    for name in ("rank0", "rank1"):
        write_keypair(str(tmp_path / "tp0"), name)
    write_keypair(str(tmp_path), "engine")
    write_keypair(str(tmp_path), "w")

    def pub(path: str) -> bytes:
        return read_key_file(str(tmp_path / path))[0]

    assert split_entry("2@dp-tp*-pp0=/k/a=b.key") == (Grant("dp-tp*-pp0", 2), "/k/a=b.key")
    assert split_entry("/k/plain.key") == (None, "/k/plain.key")
    # a relay's node: a range of ranks (issue 29), of any group or of one
    assert split_entry("8-15=/k/node1.key") == (Grant(None, 8, 15), "/k/node1.key")
    assert split_entry("0-7@dp=/k/n0.key") == (Grant("dp", 0, 7), "/k/n0.key")
    assert split_entry("3-3=/k/r.key") == (Grant(None, 3), "/k/r.key")
    node1 = Grant(None, 8, 15)
    assert node1.allows("g", 8) and node1.allows("g", 15) and not node1.allows("g", 7)
    assert not node1.allows("g", 16) and str(node1) == "dp_ranks 8-15"
    with pytest.raises(ValueError, match="low to high"):
        split_entry("9-3=/k/x.key")
    assert split_entry("x y=/k/odd.key") == (None, "x y=/k/odd.key"), "not a head: a path"
    entries = [f"@dp-tp0-pp0={tmp_path / 'tp0'}", f"@enginecore={tmp_path / 'engine.key'}",
               f"1@dp-tp*-pp1={tmp_path / 'w.key'}"]
    grants = load_grants(entries)
    assert grants == {pub("tp0/rank0.key"): {Grant("dp-tp0-pp0", 0)},
                      pub("tp0/rank1.key"): {Grant("dp-tp0-pp0", 1)},
                      pub("engine.key"): {Grant("enginecore")},
                      pub("w.key"): {Grant("dp-tp*-pp1", 1)}}
    gate = CurveGate(b"", b"", load_client_keys(entries), grants=grants)
    rank0 = pub("tp0/rank0.key").decode()
    assert gate.key_refusal(rank0, "dp-tp0-pp0", 0) is None
    assert gate.key_refusal(rank0, "dp-tp7-pp0", 0) == (
        "its CURVE key (rank0.key) is bound to dp_rank 0 of group dp-tp0-pp0"
    )
    engine = pub("engine.key").decode()
    assert gate.key_refusal(engine, "enginecore", 5) is None
    assert "any dp_rank of group enginecore" in str(gate.key_refusal(engine, "dp-tp0-pp0", 5))
    w = pub("w.key").decode()
    assert gate.key_refusal(w, "dp-tp3-pp1", 1) is None
    assert gate.key_refusal(w, "dp-tp3-pp1", 0) is not None
    assert gate.key_refusal(w, "dp-tp3-pp0", 1) is not None
