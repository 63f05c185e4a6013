"""A group re-formed at another size (vLLM's elastic EP scaling DP up or down): `--dp` is the
most ranks an epoch may have; each epoch has its first Hello's size. Driven with a fake clock."""

from __future__ import annotations

from coordd.proto import (
    Coordinator,
    Goodbye,
    Hello,
    Reject,
    RejectReason,
    Send,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    error_from_failure,
)
from coordd.proto.errors import RankLost
from coordd.proto.group_state import GroupState

MAX_DP = 4
EPOCH = 7
TIMEOUT = 10.0


def hello(rank: int, dp: int, **kw: object) -> Hello:
    kw.setdefault("incarnation", f"inc{rank}")
    kw.setdefault("config_fingerprint", f"dp={dp}")
    return Hello(dp_size=dp, dp_rank=rank, **kw)  # type: ignore[arg-type]


def report(rank: int, seq: int, epoch: int, tokens: int = 5) -> StepReport:
    return StepReport(num_tokens=tokens + rank, dp_rank=rank, epoch=epoch, seq=seq,
                      kind=StepKind.FORWARD, num_tokens_padded=tokens + rank)


class Group:
    """A coordinator serving --dp MAX_DP, with a fake clock and named peers."""

    def __init__(self) -> None:
        self.c = Coordinator(MAX_DP, epoch=EPOCH, step_timeout=TIMEOUT)
        self.now = 100.0

    def hello(self, peer: bytes, rank: int, dp: int) -> list[Send]:
        return list(self.c.receive(peer, hello(rank, dp), self.now))

    def goodbye(self, peer: bytes) -> list[Send]:
        return list(self.c.receive(peer, Goodbye(), self.now))

    def form(self, dp: int, prefix: str) -> list[bytes]:
        """Every rank of a `dp`-rank epoch registers; returns their peers."""
        peers = [f"{prefix}{r}".encode() for r in range(dp)]
        for r, p in enumerate(peers):
            (sent,) = self.hello(p, r, dp)
            assert isinstance(sent.message, Welcome) and sent.message.dp_size == dp
        return peers

    def round(self, peers: list[bytes]) -> StepDecision:
        snap = self.c.snapshot()
        sends: list[Send] = []
        for r, p in enumerate(peers):
            sends = list(self.c.receive(p, report(r, snap.seq, snap.epoch), self.now))
        (sent,) = sends
        assert isinstance(sent.message, StepDecision)
        assert sent.peers == tuple(peers)
        return sent.message


def test_the_first_hello_sets_the_size_up_to_dp() -> None:
    g = Group()
    peers = g.form(2, "a")
    decision = g.round(peers)
    assert len(decision.num_tokens_across_dp) == 2
    snap = g.c.snapshot()
    assert (snap.dp_size, snap.max_dp_size, snap.state) == (2, MAX_DP, GroupState.IDLE)


def test_a_size_over_dp_is_refused_at_once_naming_the_bound() -> None:
    g = Group()
    (sent,) = g.hello(b"x", 0, MAX_DP + 1)
    assert isinstance(sent.message, Reject)
    assert (sent.message.reason, sent.message.expected, sent.message.got) == (
        RejectReason.DP_SIZE, f"1..{MAX_DP}", str(MAX_DP + 1))


def test_scale_up_waits_for_the_old_epoch_then_forms_a_new_one() -> None:
    """The new ranks' Hellos come first (their order is vLLM's): they wait while the old
    ranks hold the group, and the last Goodbye opens a new epoch at the new size."""
    g = Group()
    old = g.form(2, "old")
    g.round(old)
    epoch = g.c.snapshot().epoch
    assert g.hello(b"new2", 2, 4) == [] and g.hello(b"new3", 3, 4) == []
    assert g.c.next_deadline() == g.now + TIMEOUT
    g.round(old)  # the old epoch goes on meanwhile
    assert g.goodbye(old[0]) == []
    sends = g.goodbye(old[1])
    assert [s.peers for s in sends] == [(b"new2",), (b"new3",)]
    for sent in sends:
        assert isinstance(sent.message, Welcome)
        assert (sent.message.epoch, sent.message.dp_size) == (epoch + 1, 4)
    for r in (0, 1):
        (sent,) = g.hello(f"re{r}".encode(), r, 4)
        assert isinstance(sent.message, Welcome) and sent.message.epoch == epoch + 1
    decision = g.round([b"re0", b"re1", b"new2", b"new3"])
    assert len(decision.num_tokens_across_dp) == 4
    assert g.c.next_deadline() is None
    assert g.c.snapshot().failures == 0


def test_scale_down_forms_a_smaller_epoch() -> None:
    g = Group()
    old = g.form(4, "old")
    g.round(old)
    for r in (0, 1):  # the remaining ranks rebuild first and wait
        assert g.hello(f"re{r}".encode(), r, 2) == []
    assert g.goodbye(old[2]) == [] and g.goodbye(old[3]) == [] and g.goodbye(old[0]) == []
    sends = g.goodbye(old[1])
    assert [s.message.dp_size for s in sends] == [2, 2]  # type: ignore[union-attr]
    decision = g.round([b"re0", b"re1"])
    assert len(decision.num_tokens_across_dp) == 2
    assert g.c.snapshot().dp_size == 2


def test_a_misconfigured_size_is_refused_at_the_step_timeout_naming_the_holders() -> None:
    """Not a re-form: the group's ranks stay, so after the step timeout the Hello is refused
    with the group's size and who holds it, and the group never noticed."""
    g = Group()
    peers = g.form(2, "a")
    assert g.hello(b"stray", 1, 3) == []
    g.now += TIMEOUT - 0.5
    assert list(g.c.on_deadline(g.now)) == []
    g.round(peers)
    g.now += 0.5
    (sent,) = g.c.on_deadline(g.now)
    assert sent.peers == (b"stray",) and isinstance(sent.message, Reject)
    assert (sent.message.reason, sent.message.expected, sent.message.got) == (
        RejectReason.DP_SIZE, "2", "3")
    assert "ranks [0, 1] still hold it" in sent.message.text
    assert g.c.next_deadline() is None
    g.round(peers)
    assert g.c.snapshot().failures == 0


def test_a_holder_asking_another_size_must_leave_first() -> None:
    g = Group()
    peers = g.form(2, "a")
    (sent,) = g.hello(peers[0], 0, 3)
    assert isinstance(sent.message, Reject) and sent.message.reason is RejectReason.DP_SIZE
    assert "holds rank 0" in sent.message.text
    g.round(peers)


def test_a_waiting_hello_whose_connection_closes_is_forgotten() -> None:
    g = Group()
    peers = g.form(2, "a")
    assert g.hello(b"w", 0, 3) == []
    assert list(g.c.peer_lost(b"w", g.now)) == []
    assert g.c.next_deadline() is None
    g.goodbye(peers[0])
    assert g.goodbye(peers[1]) == []


def test_lost_ranks_fail_the_group_and_the_waiting_size_re_forms_it() -> None:
    """A crash, not a clean leave: the old epoch's failure is counted, and the waiting Hello
    re-forms the group at its size once no connection holds a rank."""
    g = Group()
    peers = g.form(2, "a")
    assert g.hello(b"n0", 0, 3) == []
    assert list(g.c.peer_lost(peers[0], g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED
    failed = snap.last_failure
    assert isinstance(failed, StepFailed)
    assert isinstance(error_from_failure(failed), RankLost)
    (sent,) = g.c.peer_lost(peers[1], g.now)
    assert sent.peers == (b"n0",) and isinstance(sent.message, Welcome)
    assert sent.message.dp_size == 3 and sent.message.epoch == snap.epoch + 1
    for r in (1, 2):
        (w,) = g.hello(f"n{r}".encode(), r, 3)
        assert isinstance(w.message, Welcome)
    g.round([b"n0", b"n1", b"n2"])
    assert g.c.snapshot().failure is None


def _failed_with_ranks_held(g: Group) -> tuple[list[bytes], int]:
    """A 2-rank epoch whose round failed (rank 1 skipped a seq); both connections stay open,
    and rank 0 registers again, so rank 1 holds its rank from the failed epoch."""
    peers = g.form(2, "a")
    snap = g.c.snapshot()
    g.c.receive(peers[1], report(1, snap.seq + 1, snap.epoch), g.now)
    assert g.c.snapshot().state is GroupState.FAILED
    (sent,) = g.hello(peers[0], 0, 2)
    assert isinstance(sent.message, Welcome)
    assert g.c.snapshot().held == 1
    return peers, sent.message.epoch


def test_after_a_failure_a_held_rank_keeps_another_size_waiting() -> None:
    """A planted bug survived every test (issue 36, item 5): with the resize wait checking
    this epoch's members only, a Hello at another size re-formed the group while a rank of
    the failed epoch was still connected."""
    g = Group()
    peers, _ = _failed_with_ranks_held(g)
    g.goodbye(peers[0])  # this epoch's only member leaves; rank 1 is still held
    assert g.hello(b"other", 0, 3) == []
    assert g.c.snapshot().dp_size == 2 and g.c.snapshot().held == 1
    (sent,) = g.c.peer_lost(peers[1], g.now)  # the last holder gone: the wait re-forms it
    assert isinstance(sent.message, Welcome) and sent.message.dp_size == 3


def test_a_held_rank_asking_another_size_is_refused_at_once() -> None:
    """Planted (issue 36, item 5): a connection holding a rank of a failed epoch that asks
    another size was queued to wait instead of refused at once."""
    g = Group()
    peers, _ = _failed_with_ranks_held(g)
    (sent,) = g.hello(peers[1], 1, 3)
    assert isinstance(sent.message, Reject) and sent.message.reason is RejectReason.DP_SIZE
    assert "holds rank 1" in sent.message.text and g.c.next_deadline() is None


def test_one_peer_repeating_a_resize_hello_waits_once() -> None:
    """Planted (issue 36, item 5): a peer's second Hello at another size waited beside its
    first, and was refused twice."""
    g = Group()
    g.form(2, "a")
    assert g.hello(b"w", 0, 3) == [] and g.hello(b"w", 0, 3) == []
    g.now += TIMEOUT
    (sent,) = g.c.on_deadline(g.now)
    assert sent.peers == (b"w",) and isinstance(sent.message, Reject)
