"""The wire between a relay and the root coordd: msgspec Structs in their own tagged unions.

A relay (`coordd serve --relay-to ROOT`) serves one node's ranks with the ordinary rank wire
(`coordd.proto.messages`) and speaks for all of them to the root over one connection: per
group it registers once (`RelayHello`: the DP ranks it speaks for), then sends one
`RelayBundle` per round (its ranks' reports, pre-reduced for a policy round, their rows for a
gather round) and gets one `RelayAnswer` back (the root's Welcome, Reject, decision or
failure, which it fans out to its ranks). A fault found on the node goes up as a
`RelayFault`, so every other node's ranks get the same typed error, naming the same ranks.

These tags are not part of the rank wire: a rank's decoder refuses them, and the root
decodes them only from peers that are not ranks.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from coordd.proto.messages import (
    MAX_DP_SIZE,
    PROTOCOL_VERSION,
    GatherResult,
    GatherRows,
    RankList,
    Reject,
    ShortStr,
    StepDecision,
    StepFailed,
    StepKind,
    Welcome,
    decode_frame,
)
from coordd.proto.snapshot import OnRankLoss

#: Labels of a disputed bundle: one per rank it speaks for.
LabelList = Annotated[list[ShortStr], msgspec.Meta(max_length=MAX_DP_SIZE)]
#: num_tokens_padded of each rank of a bundle (int32 range, as `MAX_TOKENS`).
CountList = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]], msgspec.Meta(max_length=MAX_DP_SIZE)
]


class _RelayMessage(msgspec.Struct, array_like=True, tag_field="type", frozen=True, kw_only=True):
    pass


class RelayHello(_RelayMessage, tag="relay_hello", frozen=True):
    """A relay registers for `group`, speaking for `ranks` (every rank its node serves);
    the settings are those its first rank's Hello carried, checked as a rank's are."""

    group: ShortStr
    dp_size: int
    ranks: RankList
    config_fingerprint: ShortStr
    incarnation: ShortStr
    num_ubatches: int = 2
    #: The relay's name for errors and logs (its node).
    relay: ShortStr = ""
    protocol_version: int = PROTOCOL_VERSION


class RelayBundle(_RelayMessage, tag="bundle", frozen=True):
    """Every rank of a relay reported for round `seq`: one message for all of them.

    `ranks` are the relay's live ranks: under --on-rank-loss neutralize a rank it lost (or
    that left) is missing, and the root counts it as left out from that round on.

    A policy round carries what `decide` needs, reduced over the bundle's ranks (max padded,
    min tokens, min mode, the ANDs and ORs) and each rank's padded count (the unpadded
    decision lists them); a gather round carries the ranks' rows. `labels` is set only when
    the ranks disagreed on the round's kind or site: each rank's label, for the root's verdict
    over every rank of the group."""

    group: ShortStr
    epoch: int
    seq: int
    kind: StepKind
    ranks: RankList
    site: ShortStr = ""
    labels: LabelList = []
    padded: CountList = []
    max_padded: int = 0
    min_tokens: int = 0
    cudagraph_mode: int = 0
    all_ubatch: bool = True
    all_idle: bool = True
    any_unfinished: bool = False
    all_pause: bool = True
    any_pause: bool = False
    rows: GatherRows = []

    @property
    def label(self) -> str:
        """The round's label as its ranks gave it (a rank's `StepReport.label`)."""
        return f"gather:{self.site}" if self.kind is StepKind.GATHER else self.kind._value_


class RelayFault(_RelayMessage, tag="relay_fault", frozen=True):
    """A fault the relay found among its own ranks ended the group: the root fails it for
    every relay with the same error (its culprits must be ranks of this relay)."""

    group: ShortStr
    failure: StepFailed


class RelayLeave(_RelayMessage, tag="relay_leave", frozen=True):
    """No rank of the relay holds the group any more: every one said Goodbye between rounds,
    or left a failed group; with `lost`, every one was lost (the root's loss of those ranks)."""

    group: ShortStr
    epoch: int
    lost: bool = False


class RelayAnswer(_RelayMessage, tag="relay_answer", frozen=True):
    """The root's answer for `group`, for every rank of the relay."""

    group: ShortStr
    message: Union[Welcome, Reject, StepDecision, GatherResult, StepFailed]
    #: With a Welcome: the root's --on-rank-loss, which the relay serves the group by (the
    #: root decides for every rank, so one setting holds for all); a root without it is fail.
    on_rank_loss: OnRankLoss = OnRankLoss.FAIL
    #: With a Welcome, elastic: the relay's ranks the group has left out (lost, not back);
    #: its bundles leave them out until they register again.
    dead_ranks: RankList = []


RelayUp = Union[RelayHello, RelayBundle, RelayFault, RelayLeave]
RELAY_UP: tuple[type, ...] = (RelayHello, RelayBundle, RelayFault, RelayLeave)

_up = msgspec.msgpack.Decoder(RelayUp)
_down = msgspec.msgpack.Decoder(RelayAnswer)


def decode_from_relay(data: bytes | memoryview) -> RelayUp:
    """Decode a frame a relay sent the root; `ProtocolError` for anything else."""
    return decode_frame(_up, data, "relay frame")


def decode_from_root(data: bytes | memoryview) -> RelayAnswer:
    """Decode a frame the root sent a relay; `ProtocolError` for anything else."""
    return decode_frame(_down, data, "relay frame")
