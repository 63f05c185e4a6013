"""The registration driver on its own (no sockets, a fake clock), and the check that both
clients step it rather than keep a loop of their own (they had two, and a fix reached one)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import msgspec
import pytest

from coordd.client import aio, sync
from coordd.client._config import ClientConfig
from coordd.client._registration import HELLO_RESENDS, Registration, Step, check_unsent
from coordd.client._session import RankSession
from coordd.proto.errors import CoordinatorUnavailable, Rejected
from coordd.proto.messages import Welcome, decode_to_coordinator, reject_message

CONFIG = ClientConfig(dp_rank=1, dp_size=2, config_fingerprint="fp", address="ipc:///x.sock")
WELCOME = Welcome(epoch=3, next_seq=0, dp_size=2)


@dataclasses.dataclass
class FakeConnection:
    dropped: bool = False
    lost_after_handshake: bool = False
    handshake_refused: bool = False
    handshake_failure: str | None = None
    handshake_hint: str = ""

    def where(self) -> str:
        return "ipc:///x.sock, as given"

    def why_unreachable(self) -> str:
        return ": nothing listens"


def steps_until_wait(reg: Registration, conn: FakeConnection, now: float) -> list[Step]:
    out: list[Step] = []
    while (step := reg.next_step(conn, now)) is not Step.WAIT:
        out.append(step)
        if step is Step.DONE:
            break
    return out


def test_a_hello_is_sent_once_and_the_welcome_ends_it() -> None:
    session = RankSession(CONFIG)
    reg = Registration(session, timeout=5.0, now=100.0)
    assert session.registering
    assert decode_to_coordinator(reg.data) == session.hello_message
    conn = FakeConnection()
    assert steps_until_wait(reg, conn, 100.0) == [Step.SEND]
    assert reg.next_step(conn, 104.9) is Step.WAIT, "nothing yet: wait"
    session.receive(WELCOME)
    assert reg.next_step(conn, 104.9) is Step.DONE
    assert reg.welcome == WELCOME


def test_a_connection_that_ever_dropped_is_replaced_before_the_hello() -> None:
    reg = Registration(RankSession(CONFIG), timeout=5.0, now=0.0)
    assert steps_until_wait(reg, FakeConnection(dropped=True), 0.0) == [Step.REOPEN, Step.SEND]


def test_a_drop_after_the_handshake_resends_the_hello_over_a_new_connection() -> None:
    session = RankSession(CONFIG)
    reg = Registration(session, timeout=5.0, now=0.0)
    conn = FakeConnection()
    assert steps_until_wait(reg, conn, 0.0) == [Step.SEND]
    for resend in range(HELLO_RESENDS):
        lost = FakeConnection(dropped=True, lost_after_handshake=True)
        assert reg.next_step(lost, 1.0 + resend) is Step.REOPEN
        assert reg.resends_left == HELLO_RESENDS - resend - 1
        assert steps_until_wait(reg, FakeConnection(), 1.0 + resend) == [Step.SEND]
    # the resends are spent: it waits out the deadline, and says how many times the Hello went
    lost = FakeConnection(dropped=True, lost_after_handshake=True)
    assert reg.next_step(lost, 4.9) is Step.WAIT
    with pytest.raises(CoordinatorUnavailable) as info:
        reg.next_step(lost, 5.0)
    assert f"the Hello went {HELLO_RESENDS + 1} times" in str(info.value)
    assert "nothing listens" in str(info.value)
    reg.abort(info.value)
    assert not session.registering and session.failed == info.value


def test_no_answer_by_the_deadline_fails_the_session() -> None:
    session = RankSession(CONFIG)
    reg = Registration(session, timeout=2.0, now=10.0)
    conn = FakeConnection()
    steps_until_wait(reg, conn, 10.0)
    with pytest.raises(CoordinatorUnavailable, match=r"no answer from coordd within 2s: "):
        reg.next_step(conn, 12.0)
    # a lost connection at the deadline is no reason to send again: the time is up
    reg = Registration(session, timeout=2.0, now=10.0)
    steps_until_wait(reg, conn, 10.0)
    with pytest.raises(CoordinatorUnavailable, match="no answer"):
        reg.next_step(FakeConnection(dropped=True, lost_after_handshake=True), 12.0)


def test_a_refused_handshake_fails_at_once() -> None:
    reg = Registration(RankSession(CONFIG), timeout=5.0, now=0.0)
    steps_until_wait(reg, FakeConnection(), 0.0)
    refused = FakeConnection(handshake_refused=True, handshake_failure="wrong CURVE key",
                             handshake_hint="add the key to --curve-client-keys")
    with pytest.raises(CoordinatorUnavailable, match=r"refused the connection .*wrong CURVE key") \
            as caught:
        reg.next_step(refused, 0.1)
    assert caught.value.hint == "add the key to --curve-client-keys"  # the cause's, not the class's


def test_a_refusal_seen_before_connect_is_said_before_any_new_connection() -> None:
    """The monitor read at the registration's start found a protocol failure and its drop:
    a new connection would be refused the same way. (It did REOPEN, and the new DEALER lost
    its pipe to the same failure: the Hello waited out connect()'s 15 s.)"""
    reg = Registration(RankSession(CONFIG), timeout=15.0, now=0.0)
    seen = FakeConnection(dropped=True, handshake_refused=True, handshake_failure="no CURVE")
    with pytest.raises(CoordinatorUnavailable, match=r"refused the connection .*no CURVE"):
        reg.next_step(seen, 0.0)


def test_a_frame_waiting_for_its_pipe_gives_up_at_a_refusal_or_the_deadline() -> None:
    check_unsent(FakeConnection(), "ipc:///x.sock", deadline=5.0, now=4.9)  # wait on
    refused = FakeConnection(handshake_refused=True, handshake_failure="one side uses CURVE",
                             handshake_hint="set the keys")
    with pytest.raises(CoordinatorUnavailable, match="refused the connection") as caught:
        check_unsent(refused, "ipc:///x.sock", deadline=5.0, now=0.1)
    assert caught.value.hint == "set the keys"
    with pytest.raises(CoordinatorUnavailable, match=r"cannot reach coordd at ipc:///x.sock: "
                       "nothing listens"):
        check_unsent(FakeConnection(), "ipc:///x.sock", deadline=5.0, now=5.0)


def test_a_reject_raises_its_error() -> None:
    session = RankSession(CONFIG)
    reg = Registration(session, timeout=5.0, now=0.0)
    steps_until_wait(reg, FakeConnection(), 0.0)
    refused = Rejected("dp_size", "coordd runs dp=4", expected="4", got="2")
    session.receive(reject_message(refused))
    with pytest.raises(Rejected) as info:
        reg.next_step(FakeConnection(), 0.1)
    assert info.value == refused
    assert reg.abort(info.value) is None, "the session holds the Rejected already"
    assert session.failed == refused


def test_a_forged_hello_is_what_goes() -> None:
    session = RankSession(CONFIG)
    forged = msgspec.structs.replace(session.hello_message, protocol_version=99)
    reg = Registration(session, timeout=1.0, now=0.0, hello=forged)
    assert decode_to_coordinator(reg.data) == forged


def _names(module: object) -> set[str]:
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            out.add(node.func.attr + "()")
    return out


def test_both_clients_step_the_one_registration() -> None:
    """The rules of a registration live in `Registration` only: neither shell reads the facts
    its steps are decided from, nor begins a registration, nor counts resends itself."""
    rules = {
        "lost_after_handshake",
        "handshake_refused",
        "handshake_failure",
        "HELLO_RESENDS",
        "resends_left",
        "no_answer",
        "hello()",  # RankSession.hello(): a registration begins in Registration only
        "registration_failed",
    }
    for shell in (sync, aio):
        names = _names(shell)
        assert not names & rules, f"{shell.__name__} decides registration rules itself"
        assert {"begin_registration", "next_step", "abort"} <= names, shell.__name__
