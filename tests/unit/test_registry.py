"""coordd.core._registry, pure: Hello -> group, names, the group limit and eviction, refusals,
and which group and connection each peer belongs to. No sockets; the time is passed in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordd.core._group_names import MAX_GROUP_NAME, GroupRules, group_name_problem, shown
from coordd.core._logs import LogEvent
from coordd.core._peers import Takeovers
from coordd.core._registry import Registry
from coordd.core._registry_actions import (
    AsStranger,
    Deliver,
    GroupCreated,
    GroupDropped,
    Lost,
    Refuse,
    Registering,
)
from coordd.proto.coordinator import Coordinator
from coordd.proto.messages import (
    Hello,
    Reject,
    RejectReason,
    StepKind,
    StepReport,
    Welcome,
)
from coordd.proto.snapshot import OnRankLoss

WALL = 1_700_000_000.0


@dataclass(eq=False)
class G:
    name: str
    coordinator: Coordinator


def registry(dp: int = 2, max_groups: int = 4, groups: tuple[str, ...] = ("*",)) -> Registry[G]:
    """A registry that admits any group name (`groups`: the --groups rules)."""
    return Registry(
        dp, G, max_groups=max_groups, step_timeout=10.0, on_rank_loss=OnRankLoss.FAIL,
        rules=GroupRules(groups),
    )


def hello(rank: int = 0, group: str = "g", dp: int = 2, **kw: object) -> Hello:
    return Hello(dp_size=dp, dp_rank=rank, config_fingerprint="f", incarnation="i", group=group,
                 **kw)  # type: ignore[arg-type]


def refusal(actions: list[object]) -> Refuse:
    """The one Refuse among `actions`, beside at most the lines to log."""
    actions = [a for a in actions if type(a) is not LogEvent]
    assert len(actions) == 1 and type(actions[0]) is Refuse, actions
    return actions[0]


def sent(actions: list[object]) -> list[tuple[tuple[bytes, ...], object]]:
    return [send for a in actions if type(a) is Deliver for send in a.sends]


def test_the_first_hello_creates_its_group_and_binds_the_peer_to_its_connection() -> None:
    reg = registry()
    actions = reg.hello(b"r0", hello(0), fd=7, now=1.0, wall=WALL, address="a0")
    kinds = [type(a) for a in actions]
    assert kinds == [GroupCreated, Registering, Deliver]
    group = reg.groups["g"]
    assert actions[0] == GroupCreated(group, int(WALL * 1000), 1)
    assert actions[1] == Registering(group, b"r0", hello(0), "a0")
    assert [type(m) for _, m in sent(actions)] == [Welcome]
    assert reg.peer_group[b"r0"] is group and reg.peer_fd[b"r0"] == 7 and reg.fd_peer[7] == b"r0"
    # the second rank joins the same group; nothing is created
    actions = reg.hello(b"r1", hello(1), fd=8, now=1.0, wall=WALL)
    assert [type(a) for a in actions] == [Registering, Deliver]
    assert reg.registered_fds() == {7, 8}


def test_a_message_counts_only_over_the_connection_that_registered_its_rank() -> None:
    reg = registry()
    reg.hello(b"r0", hello(0), fd=7, now=1.0, wall=WALL)
    group = reg.groups["g"]
    assert reg.peer_group[b"r0"] is group
    assert reg.speaks_for(b"r0", 7)
    assert not reg.speaks_for(b"r0", 9)  # another connection
    assert reg.speaks_for(b"nobody", 9)  # no connection bound: a stranger's (no group)
    report = StepReport(epoch=1, seq=0, kind=StepKind.FORWARD, dp_rank=0, num_tokens=1,
                        num_tokens_padded=1, want_ubatch=False, cudagraph_mode=0,
                        has_unfinished=False)
    line, answer = reg.other_connection(b"r0", report, "10.0.0.9", now=2.0)
    assert answer == AsStranger(b"r0", report)
    assert type(line) is LogEvent and line.name == "rank takeover refused"
    assert line.fields["address"] == "10.0.0.9" and line.fields["kind"] == "other_connection"
    assert reg.takeovers.refused[("g", Takeovers.OTHER_CONNECTION)] == 1
    # once the registering connection closed, the routing id is not bound to any
    reg.closed(7, now=3.0)
    assert reg.speaks_for(b"r0", 9)


def test_a_hello_over_another_connection_while_the_registering_one_is_open_is_refused() -> None:
    reg = registry()
    reg.hello(b"r0", hello(0), fd=7, now=1.0, wall=WALL)
    actions = reg.hello(b"r0", hello(0), fd=9, now=2.0, wall=WALL, address="10.0.0.9")
    assert [a for a in actions if type(a) is not LogEvent] == [AsStranger(b"r0", hello(0))]
    assert reg.takeovers.refused[("g", Takeovers.OTHER_CONNECTION)] == 1
    assert reg.peer_fd[b"r0"] == 7 and 9 not in reg.fd_peer  # the rank's connection is kept


def test_a_routing_id_that_starts_with_a_zero_byte_never_registers() -> None:
    reg = registry()
    refused = refusal(reg.hello(b"\x00\x12\x34\x56\x78", hello(0), fd=7, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.ROUTING_ID.value
    assert "set no routing id of its own" in refused.error.detail
    assert not reg.groups and not reg.peer_fd


@pytest.mark.parametrize(
    ("name", "problem"),
    [("", "it has 0 characters"), ("a b", "it holds ' '"), ("x" * (MAX_GROUP_NAME + 1), None),
     ("tab\there", "it holds '\\t'")],
)
def test_a_bad_group_name_is_refused_and_creates_nothing(name: str, problem: str | None) -> None:
    reg = registry()
    refused = refusal(reg.hello(b"r0", hello(0, group=name), fd=7, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP.value
    assert refused.error.detail.startswith(f"field group: {shown(name)} cannot name a group")
    assert refused.group == shown(name)
    if problem is not None:
        assert group_name_problem(name) == problem
    assert not reg.groups and b"r0" not in reg.peer_group


def test_settings_no_group_could_admit_create_none() -> None:
    reg = registry(dp=2)
    refused = refusal(reg.hello(b"r0", hello(0, dp=3), fd=7, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.DP_SIZE.value
    assert not reg.groups


def test_the_group_limit_refuses_a_new_group_until_one_without_members_makes_room() -> None:
    reg = registry(dp=1, max_groups=2)
    reg.hello(b"a", hello(0, group="a", dp=1), fd=1, now=1.0, wall=WALL)
    reg.hello(b"b", hello(0, group="b", dp=1), fd=2, now=1.0, wall=WALL)
    refused = refusal(reg.hello(b"c", hello(0, group="c", dp=1), fd=3, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP_LIMIT.value
    assert refused.error.detail == (
        "coordd serves 2 groups, its limit (--max-groups 2; a group --groups names exactly "
        "always gets a slot): group 'c' cannot be created"
    )
    assert (refused.error.expected, refused.error.got) == ("at most 2 groups", "3 groups")
    # a's only rank leaves: a has no members and no round, so c takes its slot
    group_a = reg.groups["a"]
    lost = reg.closed(1, now=2.0)
    assert [type(x) for x in lost] == [Deliver, Lost]
    actions = reg.hello(b"c", hello(0, group="c", dp=1), fd=3, now=3.0, wall=WALL)
    dropped = [x for x in actions if type(x) is GroupDropped]
    assert dropped == [GroupDropped(group_a, group_a.coordinator.snapshot().epoch)]
    assert list(reg.groups) == ["b", "c"]
    assert b"a" not in reg.peer_group  # the dropped group's peers are forgotten


def test_epochs_grow_across_groups_even_within_one_millisecond() -> None:
    reg = registry(dp=1)
    for name in "xyz":
        reg.hello(name.encode(), hello(0, group=name, dp=1), fd=ord(name), now=1.0, wall=WALL)
    epochs = [g.coordinator.snapshot().epoch for g in reg.groups.values()]
    assert epochs == sorted(set(epochs)) and epochs[0] == int(WALL * 1000)


def test_a_client_belongs_to_one_group() -> None:
    reg = registry()
    reg.hello(b"r0", hello(0, group="g"), fd=7, now=1.0, wall=WALL)
    refused = refusal(reg.hello(b"r0", hello(0, group="h"), fd=7, now=2.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP.value
    assert refused.error.detail == (
        "this connection is registered as rank 0 of group 'g', not h: a client belongs to one "
        "group"
    )
    assert "h" not in reg.groups


def test_a_peer_that_left_its_group_may_join_another_and_its_old_group_is_told() -> None:
    reg = registry(dp=1)
    reg.hello(b"p", hello(0, group="g", dp=1), fd=7, now=1.0, wall=WALL)
    old = reg.groups["g"]
    reg.closed(7, now=1.5)  # p's connection closed: it left g (its entry is kept a while)
    assert reg.peer_group[b"p"] is old
    actions = reg.hello(b"p", hello(0, group="h", dp=1), fd=9, now=2.0, wall=WALL)
    assert isinstance(actions[0], GroupCreated)
    assert any(type(a) is Deliver and a.group is old for a in actions)  # p's rejoin there: void
    assert reg.peer_group[b"p"] is reg.groups["h"]


def test_a_refused_peer_stays_a_stranger() -> None:
    """A Hello refused by its group (the rank is taken) keeps nothing of the peer: no peer
    entry (the flood cut-off applies to it) and no descriptor entry (nor does the grace
    exempt it); it may still register elsewhere."""
    reg = registry(dp=1)
    reg.hello(b"p", hello(0, group="g", dp=1), fd=7, now=1.0, wall=WALL)
    actions = reg.hello(b"q", hello(0, group="g", dp=1), fd=8, now=1.0, wall=WALL)
    assert [type(m) for _, m in sent(actions)] == [Reject]
    assert reg.takeovers.refused[("g", Takeovers.RANK_HELD)] == 1
    assert b"q" not in reg.peer_group and b"q" not in reg.peer_fd and 8 not in reg.fd_peer
    assert 8 not in reg.registered_fds()
    assert reg.closed(8, now=1.5) == []
    actions = reg.hello(b"q", hello(0, group="h", dp=1), fd=8, now=2.0, wall=WALL)
    assert isinstance(actions[0], GroupCreated)
    assert reg.peer_group[b"q"] is reg.groups["h"] and reg.fd_peer[8] == b"q"


def test_a_key_bound_to_other_ranks_cannot_register() -> None:
    reg = registry()
    reg.key_refusal = lambda key, group, rank: (
        None if (key, rank) == ("K0", 0) else "bound to dp_rank 0"
    )
    refused = refusal(reg.hello(b"r1", hello(1), fd=7, now=1.0, wall=WALL, key="K0"))
    assert refused.error.reason == RejectReason.CURVE_KEY.value
    assert refused.error.detail == (
        "this connection may not register as dp_rank 1 of group g: bound to dp_rank 0"
    )
    # no group g yet: counted outside any group (a record per unvalidated name would grow)
    assert reg.takeovers.refused == {("-", Takeovers.KEY_BOUND): 1}
    assert [type(a) for a in reg.hello(b"r0", hello(0), fd=8, now=1.0, wall=WALL, key="K0")] == [
        GroupCreated, Registering, Deliver]
    refusal(reg.hello(b"r1", hello(1), fd=9, now=1.0, wall=WALL, key="K0"))
    assert reg.takeovers.refused[("g", Takeovers.KEY_BOUND)] == 1


def test_the_peer_map_is_bounded() -> None:
    reg = registry(dp=1)
    reg.hello(b"member", hello(0, dp=1), fd=1, now=1.0, wall=WALL)
    for n in range(300):
        actions = reg.hello(f"x{n}".encode(), hello(0, dp=1), fd=100 + n, now=1.0, wall=WALL)
        (_, answer), = sent(actions)
        assert type(answer) is Reject and answer.reason is RejectReason.RANK_TAKEN
    assert len(reg.peer_group) <= 2 * 1 * 1 + 256
    assert b"member" in reg.peer_group


def test_a_closed_connection_loses_its_rank_in_its_own_group_only() -> None:
    reg = registry(dp=1)
    reg.hello(b"a", hello(0, group="a", dp=1), fd=1, now=1.0, wall=WALL)
    reg.hello(b"b", hello(0, group="b", dp=1), fd=2, now=1.0, wall=WALL)
    group_a = reg.groups["a"]
    actions = reg.closed(1, now=2.0)
    assert actions[-1] == Lost(group_a, b"a", 0)
    assert all(a.group is group_a for a in actions if type(a) is Deliver)
    assert not group_a.coordinator.snapshot().members
    assert reg.groups["b"].coordinator.snapshot().members
    assert reg.closed(1, now=2.0) == []  # once
    assert reg.closed(99, now=2.0) == []  # a stranger's connection
    assert reg.registered_fds() == {2}


def test_only_some_groups_epoch_is_known() -> None:
    reg = registry(dp=1)
    reg.hello(b"a", hello(0, dp=1), fd=1, now=1.0, wall=WALL)
    epoch = reg.groups["g"].coordinator.snapshot().epoch
    assert reg.known_epoch(epoch) and not reg.known_epoch(epoch + 1)


# -- groups are admitted, not self-declared (issue 21) -------------------------------------------


def test_the_default_rules_admit_vllms_groups_and_the_clients_default_only() -> None:
    rules = GroupRules()
    for name in ("dp-tp0-pp0", "dp-tp3-pp1", "dp-tp1-pp0-pcp2", "dp-tp0-pp0-engine",
                 "enginecore", "default"):
        assert rules.admits(name), name
    for name in ("junk", "g", "dp-tp0", "enginecore2", "Default", "x-dp-tp0-pp0"):
        assert not rules.admits(name), name
    assert rules.exact == {"dp-tp0-pp0", "enginecore", "default"}


def test_a_hello_for_an_unexpected_group_is_refused_and_nothing_is_kept() -> None:
    reg = registry(groups=("enginecore", "dp-tp*-pp*"))
    refused = refusal(reg.hello(b"j", hello(0, group="junk"), fd=7, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP_UNEXPECTED.value
    assert refused.error.detail == (
        "group 'junk' is not one this deployment expects (coordd --groups enginecore,dp-tp*-pp*)"
    )
    assert refused.error.hint and "--groups" in refused.error.hint
    assert not reg.groups and not reg.peer_group and not reg.peer_fd and not reg.fd_peer


def test_an_unexpected_name_is_refused_before_the_key_check_and_leaves_no_record() -> None:
    """Over CURVE with keys bound to ranks, Hellos for another rank under new names: refused
    as unexpected first, with no takeover record (or log line, or series) per name."""
    reg = registry(groups=("g",))
    reg.key_refusal = lambda key, group, rank: "bound to dp_rank 0" if rank else None
    for n in range(100):
        refused = refusal(reg.hello(b"r%d" % n, hello(1, group=f"n{n}"), fd=7, now=1.0,
                                    wall=WALL, key="K0"))
        assert refused.error.reason == RejectReason.GROUP_UNEXPECTED.value
    assert not reg.takeovers.refused and not reg.groups


def test_exact_names_always_get_a_slot_and_patterns_share_the_limit() -> None:
    reg = registry(dp=2, max_groups=2, groups=("enginecore", "dp-tp*-pp*"))
    for t in range(2):  # two groups of one rank of two: they fill the limit
        reg.hello(b"j%d" % t, hello(0, group=f"dp-tp{t}-pp9"), fd=10 + t, now=1.0, wall=WALL)
    refused = refusal(reg.hello(b"x", hello(0, group="dp-tp5-pp9"), fd=20, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP_LIMIT.value
    actions = reg.hello(b"e", hello(0, group="enginecore"), fd=21, now=1.0, wall=WALL)
    assert isinstance(actions[0], GroupCreated) and "enginecore" in reg.groups
    assert len(reg.groups) == 3


def test_expected_names_a_pattern_admits_always_get_a_slot() -> None:
    """`--expect-groups dp-tp1-pp0`: junk that the pattern admits fills the limit, and the
    expected worker group of TP rank 1 still gets its slot."""
    reg = Registry(2, G, max_groups=2, step_timeout=10.0, on_rank_loss=OnRankLoss.FAIL,
                   rules=GroupRules(("dp-tp*-pp*",), always=("dp-tp1-pp0",)))
    for t in (5, 6):
        reg.hello(b"j%d" % t, hello(0, group=f"dp-tp{t}-pp0"), fd=10 + t, now=1.0, wall=WALL)
    refused = refusal(reg.hello(b"x", hello(0, group="dp-tp7-pp0"), fd=20, now=1.0, wall=WALL))
    assert refused.error.reason == RejectReason.GROUP_LIMIT.value
    actions = reg.hello(b"w", hello(0, group="dp-tp1-pp0"), fd=21, now=1.0, wall=WALL)
    assert isinstance(actions[0], GroupCreated) and "dp-tp1-pp0" in reg.groups
    with pytest.raises(ValueError, match="not one --groups dp-tp\\*-pp\\* admits"):
        GroupRules(("dp-tp*-pp*",), always=("enginecore",))


def test_rules_refuse_bad_patterns() -> None:
    with pytest.raises(ValueError):
        GroupRules(())
    with pytest.raises(ValueError):
        GroupRules(("a b",))


def test_a_members_undecodable_message_fails_its_round_naming_it() -> None:
    reg = registry(dp=2)
    reg.hello(b"r0", hello(0), fd=7, now=1.0, wall=WALL)
    reg.hello(b"r1", hello(1), fd=8, now=1.0, wall=WALL)
    group = reg.groups["g"]
    epoch = group.coordinator.snapshot().epoch
    report = StepReport(epoch=epoch, seq=0, kind=StepKind.FORWARD, dp_rank=0, num_tokens=1,
                        num_tokens_padded=1, want_ubatch=False, cudagraph_mode=0,
                        has_unfinished=False)
    group.coordinator.receive(b"r0", report, 2.0)
    assert reg.undecodable(b"r1", 99, "too long", 2.1) == []  # not over its connection
    assert reg.undecodable(b"zz", 7, "too long", 2.1) == []  # not a member
    (deliver,) = reg.undecodable(b"r1", 8, "array longer than 256", 2.1)
    assert isinstance(deliver, Deliver)
    ((peers, failure),) = deliver.sends
    assert set(peers) == {b"r0", b"r1"}
    assert failure.reason.value == "protocol" and failure.culprits == [1]
    assert "array longer than 256" in failure.text
    assert reg.undecodable(b"r1", 8, "again", 2.2) == [Deliver(group, ())]  # failed already


def test_a_members_violation_loses_its_rank_and_makes_it_a_stranger() -> None:
    reg = registry(dp=1)
    reg.hello(b"r0", hello(0, dp=1), fd=7, now=1.0, wall=WALL)
    group = reg.groups["g"]
    assert reg.member(b"r0", 7) is group and reg.member(b"r0", 8) is None
    actions = reg.violation(b"r0", "too many messages", 2.0)
    assert [type(a) for a in actions] == [Deliver, Lost]
    assert not group.coordinator.snapshot().members
    assert b"r0" not in reg.peer_group and reg.closed(7, 2.5) == []


def test_key_bound_refusals_under_many_admitted_names_keep_one_record() -> None:
    """Issue 21, 4: over CURVE, Hellos for another rank under new names a pattern admits:
    each refused (the key is bound to rank 0), none creates a group, and what is kept is one
    record outside any group, not one per name (before: a record, a WARNING line and a
    /metrics series per name; 60,000 Hellos, +16 MB)."""
    reg = registry(groups=("dp-tp*-pp*",))
    reg.key_refusal = lambda key, group, rank: None if rank == 0 else "bound to dp_rank 0"
    for n in range(2000):
        refused = refusal(reg.hello(b"p%d" % n, hello(1, group=f"dp-tp{n}-pp0"), fd=7, now=1.0,
                                    wall=WALL, key="K0"))
        assert refused.error.reason == RejectReason.CURVE_KEY.value
    assert reg.takeovers.refused == {("-", Takeovers.KEY_BOUND): 2000}
    assert not reg.groups and not reg.peer_group and not reg.peer_fd


def test_rank_held_refusals_under_cycled_names_go_with_their_groups() -> None:
    """Issue 28, defect 5: one peer cycling group names a pattern admits, each with a Hello for
    a rank another of its connections holds (`rank_held`): the refusal was counted under the
    group's name and never dropped with the group (400 names a second: 4,800 series of
    coordd_rank_takeovers_refused_total in 12 s, a WARNING line per name). Now the record holds
    only live groups' names (at most --max-groups x kinds), and the lines it returns for the
    shell to log are bounded."""
    from coordd.core._logs import LogEvent
    from coordd.core._peers import LOG_LINES

    reg = registry(max_groups=4, groups=("dp-tp*-pp*",))
    lines: list[LogEvent] = []
    names = 2000
    for n in range(names):
        name = f"dp-tp{n}-pp0"
        holder, thief = b"h%d" % n, b"t%d" % n
        reg.hello(holder, hello(0, group=name), fd=2 * n + 10, now=1.0 + n / 400, wall=WALL)
        actions = reg.hello(thief, hello(0, group=name), fd=2 * n + 11, now=1.0 + n / 400,
                            wall=WALL)
        assert any(type(m) is Reject and m.reason is RejectReason.RANK_TAKEN
                   for _, m in sent(actions))
        lines += [a for a in actions if type(a) is LogEvent and a.name == "rank takeover refused"]
        reg.closed(2 * n + 10, now=1.0 + n / 400)  # the holder leaves: the group may go
    assert len(reg.groups) <= 4
    assert set(reg.takeovers.refused) <= {(g, Takeovers.RANK_HELD) for g in reg.groups}
    assert sum(reg.takeovers.refused.values()) <= 4
    seconds = names / 400
    assert 1 <= len(lines) <= LOG_LINES * (seconds // 10 + 1), len(lines)


def test_a_named_group_that_stopped_cleanly_keeps_its_slot() -> None:
    """Issue 28 (seen, not yet shown): creating pattern groups at --max-groups evicted the
    oldest empty group, an expected one that stopped cleanly included, and /readyz then said it
    "has not registered" (503). A named group keeps its slot; the pattern groups share theirs."""
    from coordd.proto.messages import Goodbye

    reg = Registry(1, G, max_groups=2, step_timeout=10.0, on_rank_loss=OnRankLoss.FAIL,
                   rules=GroupRules(("dp-tp*-pp*",), always=("dp-tp0-pp0",)))
    reg.hello(b"r", hello(0, group="dp-tp0-pp0", dp=1), fd=1, now=1.0, wall=WALL)
    reg.groups["dp-tp0-pp0"].coordinator.receive(b"r", Goodbye(), 2.0)  # a clean stop
    assert reg.groups["dp-tp0-pp0"].coordinator.snapshot().stopped
    reg.hello(b"j1", hello(0, group="dp-tp1-pp0", dp=1), fd=2, now=3.0, wall=WALL)
    reg.closed(2, now=3.5)  # its rank leaves: a pattern group with no members
    actions = reg.hello(b"j2", hello(0, group="dp-tp2-pp0", dp=1), fd=3, now=4.0, wall=WALL)
    assert [a.group.name for a in actions if type(a) is GroupDropped] == ["dp-tp1-pp0"]
    assert "dp-tp0-pp0" in reg.groups
    # dp-tp2-pp0 keeps its member: no pattern slot is free, and the named one is not taken
    actions = reg.hello(b"j4", hello(0, group="dp-tp4-pp0", dp=1), fd=5, now=6.0, wall=WALL)
    assert refusal(actions).error.reason == RejectReason.GROUP_LIMIT.value
    assert "dp-tp0-pp0" in reg.groups


def test_only_pattern_groups_members_are_evictable_newest_group_first() -> None:
    """Issue 28, defect 1: what `Admission.enforce` shuts first while members crowd the cap:
    members of groups only a pattern admits, the newest group's first; a named group's
    (--groups or --expect-groups) never, however new."""
    reg = Registry(1, G, max_groups=8, step_timeout=10.0, on_rank_loss=OnRankLoss.FAIL,
                   rules=GroupRules(("dp-tp*-pp*", "enginecore"), always=("dp-tp0-pp0",)))
    for fd, name in enumerate(["dp-tp0-pp0", "dp-tp5-pp0", "dp-tp6-pp0", "enginecore"], 1):
        reg.hello(b"p%d" % fd, hello(0, group=name, dp=1), fd=fd, now=1.0, wall=WALL)
    assert reg.evictable_fds() == [3, 2]


def test_standing_tells_the_drain_where_a_message_goes_by_the_speaks_for_rule() -> None:
    """Issue 31: the drain asks `standing` instead of re-typing `speaks_for` on the registry's
    maps; every case agrees with the rule."""
    from coordd.core._registry import DETACHED, MEMBER, OTHER_CONNECTION, STRANGER

    reg = registry()
    reg.hello(b"r0", hello(0), fd=7, now=1.0, wall=WALL)
    group = reg.groups["g"]
    assert reg.standing(b"nobody", 7) == (None, STRANGER)
    assert reg.standing(b"r0", 7) == (group, MEMBER) and reg.speaks_for(b"r0", 7)
    assert reg.standing(b"r0", 9) == (group, OTHER_CONNECTION) and not reg.speaks_for(b"r0", 9)
    assert reg.holds_fd(7) and not reg.holds_fd(9) and list(reg.introduced_fds()) == [7]
    reg.closed(7, now=2.0)  # the rank is lost; its peer entry stays until it is forgotten
    assert reg.standing(b"r0", 9) == (group, DETACHED) and reg.speaks_for(b"r0", 9)
    assert reg.connections_held() == 0 and reg.group_of(b"r0") is group
