"""How many groups one coordd keeps, for flat and relayed groups alike: `--max-groups` bounds
the groups a pattern admits, an exactly named group (`--groups`, `--expect-groups`) always gets
a slot, and at the limit the oldest group no connection holds is dropped to make room (a
stranger's registrations cannot hold the slots forever). Pure: the caller says which of its
groups are idle and drops the one named."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from coordd.core._group_names import GroupRules
from coordd.proto.errors import Rejected
from coordd.proto.messages import RejectReason

X = TypeVar("X")


def to_drop(groups: Mapping[str, X], rules: GroupRules, idle: Callable[[X], bool]) -> str | None:
    """The oldest group (in `groups`' order) that no exact name keeps and that `idle` says no
    connection holds, or None. An exactly named group is never dropped: it has a slot of its
    own, and an expected group that stopped cleanly would read "has not registered" once
    dropped."""
    for name, group in groups.items():
        if name not in rules.exact and idle(group):
            return name
    return None


def limit_refusal(
    name: str, groups: Mapping[str, X], rules: GroupRules, max_groups: int, kind: str = ""
) -> Rejected | None:
    """Why a new group `name` gets no slot (after `to_drop` made what room it could), or None."""
    if len(groups) < max_groups or name in rules.exact:
        return None
    return Rejected(
        RejectReason.GROUP_LIMIT.value,
        f"coordd serves {len(groups)} {kind}groups, its limit (--max-groups {max_groups}; a "
        f"group --groups names exactly always gets a slot): group {name!r} cannot be created",
        expected=f"at most {max_groups} groups",
        got=f"{len(groups) + 1} groups",
    )
