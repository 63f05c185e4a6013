"""Who may join the group: the checks a `Hello` must pass, each failure a `Rejected`.

Pure functions of the Hello and the current members, so the coordinator and the device path
(which admits its ranks by these same rules) refuse a rank with the very same error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from coordd.proto.errors import Rejected
from coordd.proto.messages import PROTOCOL_VERSION, Hello, RejectReason
from coordd.proto.snapshot import Member


def _reject(reason: RejectReason, detail: str, expected: object, got: object) -> Rejected:
    return Rejected(reason.value, detail, expected=str(expected), got=str(got))


def check_basics(hello: Hello, max_dp_size: int) -> None:
    """What every Hello must satisfy, whoever else is registered. `max_dp_size` is coordd's
    `--dp`: the most ranks a group may have; a group forms at the size its Hellos say
    (`resize_refused` for one that asks another size while the group's ranks stay)."""
    if hello.protocol_version != PROTOCOL_VERSION:
        raise _reject(
            RejectReason.VERSION,
            f"rank {hello.dp_rank} speaks protocol "
            f"{hello.protocol_version}, coordd speaks {PROTOCOL_VERSION}",
            PROTOCOL_VERSION,
            hello.protocol_version,
        )
    if not 1 <= hello.dp_size <= max_dp_size:
        raise _reject(
            RejectReason.DP_SIZE,
            f"rank {hello.dp_rank} has dp_size={hello.dp_size}, coordd serves groups of at "
            f"most --dp {max_dp_size} ranks",
            f"1..{max_dp_size}",
            hello.dp_size,
        )
    if not 0 <= hello.dp_rank < hello.dp_size:
        raise _reject(
            RejectReason.RANK_RANGE,
            f"dp_rank {hello.dp_rank} is outside 0..{hello.dp_size - 1}",
            f"0..{hello.dp_size - 1}",
            hello.dp_rank,
        )
    if hello.num_ubatches < 1:
        raise _reject(
            RejectReason.NUM_UBATCHES,
            f"rank {hello.dp_rank} has num_ubatches={hello.num_ubatches}",
            ">= 1",
            hello.num_ubatches,
        )


def check_membership(
    peer: bytes, hello: Hello, members: Mapping[int, Member], peer_rank: Mapping[bytes, int]
) -> None:
    """A Hello against the ranks held by live connections (`members`: the current epoch's,
    and after a failure also the failed epoch's ranks still connected): its rank is free (or
    already this peer's), this peer holds no other rank, and it has the group's settings
    (those of the lowest rank held; the only holder may change them by registering again).

    The same checks apply to the first registration and to the one after a failure: the
    settings a new epoch must match (config_fingerprint, num_ubatches, group) are those of the
    ranks still connected. Only once no connection holds a rank of the group (every rank left
    or was lost) may a Hello bring new settings, as the group's very first one did; to change
    the fingerprint deliberately, stop every rank (or restart coordd) and start them with the
    new config."""
    held = members.get(hello.dp_rank)
    if held is not None and held.peer != peer:
        # Nothing of the holder is echoed (its incarnation, its connection): what identifies
        # a connection stays between it and coordd.
        raise _reject(
            RejectReason.RANK_TAKEN,
            f"dp_rank {hello.dp_rank} is held by another live connection (a rank is the "
            "connection that registered it, until that connection closes)",
            "a dp_rank no live connection holds",
            hello.dp_rank,
        )
    other = peer_rank.get(peer)
    if other is not None and other != hello.dp_rank:
        raise _reject(
            RejectReason.RANK_TAKEN,
            f"this connection is already registered as rank {other}",
            other,
            hello.dp_rank,
        )
    if not members or (held is not None and len(members) == 1):
        return
    group = members[min(members)].hello
    for reason, name in (
        (RejectReason.GROUP, "group"),
        (RejectReason.NUM_UBATCHES, "num_ubatches"),
        (RejectReason.FINGERPRINT, "config_fingerprint"),
    ):
        want, got = getattr(group, name), getattr(hello, name)
        if want != got:
            raise _reject(
                reason,
                f"rank {hello.dp_rank} has {name}={got!r}, the group "
                f"(rank {group.dp_rank}) has {want!r}",
                want,
                got,
            )


def resize_refused(hello: Hello, dp_size: int, holders: Iterable[int], waited: float) -> Rejected:
    """A Hello at another size than the group's, refused: the group's ranks did not leave
    within `waited` seconds, so this is a misconfigured rank rather than the group re-forming."""
    return _reject(
        RejectReason.DP_SIZE,
        f"rank {hello.dp_rank} has dp_size={hello.dp_size}, the group runs at dp_size="
        f"{dp_size} and ranks {sorted(holders)} still hold it: a group re-forms at another size "
        f"only once its ranks leave (waited {waited:g} s)",
        dp_size,
        hello.dp_size,
    )


def resize_while_holding(hello: Hello, rank: int, dp_size: int) -> Rejected:
    """A connection that holds a rank asks another size: it must leave first."""
    return _reject(
        RejectReason.DP_SIZE,
        f"this connection holds rank {rank} of the group at dp_size={dp_size}: close it (a "
        f"Goodbye) and register at dp_size={hello.dp_size} over a new one",
        dp_size,
        hello.dp_size,
    )


def rank_taken(rank: int) -> Rejected:
    """A second peer wants a lost rank that another peer is already queued to take back."""
    return Rejected(
        RejectReason.RANK_TAKEN.value,
        f"dp_rank {rank} is already rejoining over another live connection",
        expected="a dp_rank no live connection holds",
        got=str(rank),
    )
