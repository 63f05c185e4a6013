"""The step policy ("vllm"): the reports of all ranks become one decision.

A pure function, so the coordinator, the device path and the tests all apply the very same
rules. Over the live ranks' reports, with P = max(num_tokens_padded), U = min(num_tokens) and
n = num_ubatches (a group setting every rank shares):
- `cudagraph_mode` = the min (NONE=0 < PIECEWISE=1 < FULL=2: what every rank can run);
- `should_ubatch` = every rank wants it and the last micro-batch is not empty, i.e. not
  (P // n) * (n - 1) >= U;
- `should_pad` = cudagraph_mode != 0 or should_ubatch;
- `num_tokens_across_dp` = [P] * dp if should_pad, else each rank's num_tokens_padded;
- `any_unfinished` = OR of has_unfinished; `all_idle` = every rank reported 0 tokens;
- `should_pause` = AND of want_pause; `any_pause` = OR of want_pause;
- `dead_ranks` = the ranks left out (elastic mode), which count as neutral values.
A report is valid when its kind is a policy round's (not "gather"), 0 <= num_tokens <=
num_tokens_padded <= MAX_TOKENS (2**31 - 1: vLLM builds int32 tensors of them), cudagraph_mode
is 0, 1 or 2, and the flags are bools (`validate_report`, in coordd and the device path when a
report arrives; the client refuses before sending only what the wire cannot carry,
`check_carriable`, and sends the rest so that every rank gets the same `InvalidReport`).

A gather round has no rules: its result is the reports' values as they came. Its only check
(`validate_gather`) is that every rank sends as many values as the round's first report, and
no more than fit in one frame at the group's dp size.

A rank checks each answer against what it sent: `decision_misfit`, `gather_misfit`.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordd.proto.errors import InvalidAnswer, InvalidReport
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    GatherReport,
    GatherResult,
    StepDecision,
    StepKind,
    StepReport,
    max_gather_values,
)

CUDAGRAPH_MODES = (0, 1, 2)  # NONE, PIECEWISE, FULL
_MAX_MODE = max(CUDAGRAPH_MODES)
#: Largest token count a report may carry: every rank's engine builds int32 tensors of the
#: decision's counts (vLLM's `num_tokens_across_dp`), so a larger one would fail there.
MAX_TOKENS = 2**31 - 1
_INT32 = "int32: the engines' token tensors"
_FLAGS = ("want_ubatch", "has_unfinished", "want_pause")
_COUNTS = ("num_tokens", "num_tokens_padded", "cudagraph_mode")
_GATHER = StepKind.GATHER


def validate_report(rank: int, report: StepReport) -> None:
    """Raise `InvalidReport` naming the rank, the first field out of range, its value and the
    range. Cheap (a few comparisons): it runs on every report, in the client and in coordd."""
    # The common case first, in one expression: exact ints in range and exact bools, of a
    # policy round's kind (tests/unit/test_report_fast_path.py pins it to the checks below).
    tokens, padded, mode = report.num_tokens, report.num_tokens_padded, report.cudagraph_mode
    if (
        type(tokens) is int
        and type(padded) is int
        and 0 <= tokens <= padded <= MAX_TOKENS
        and type(mode) is int
        and 0 <= mode <= 2
        and type(report.want_ubatch) is bool
        and type(report.has_unfinished) is bool
        and type(report.want_pause) is bool
        and report.kind is not _GATHER
    ):
        return
    _validate_fields(rank, report)


def _validate_fields(rank: int, report: StepReport) -> None:
    """`validate_report`'s rule check by check, naming the first that breaks it."""
    if report.kind is StepKind.GATHER:
        raise InvalidReport(
            rank, "kind", StepKind.GATHER.value, "forward, draft or state (gather: a GatherReport)"
        )
    tokens, padded = report.num_tokens, report.num_tokens_padded
    if type(tokens) is not int and not _is_int(tokens):
        raise InvalidReport(rank, "num_tokens", tokens, f"an int in 0..{MAX_TOKENS}")
    if tokens < 0:
        raise InvalidReport(rank, "num_tokens", tokens, ">= 0")
    if tokens > MAX_TOKENS:
        raise InvalidReport(rank, "num_tokens", tokens, f"0..{MAX_TOKENS} ({_INT32})")
    if type(padded) is not int and not _is_int(padded):
        raise InvalidReport(
            rank, "num_tokens_padded", padded, f"an int in num_tokens ({tokens})..{MAX_TOKENS}"
        )
    if padded < tokens:
        raise InvalidReport(rank, "num_tokens_padded", padded, f">= num_tokens ({tokens})")
    if padded > MAX_TOKENS:
        raise InvalidReport(
            rank, "num_tokens_padded", padded, f"num_tokens ({tokens})..{MAX_TOKENS} ({_INT32})"
        )
    mode = report.cudagraph_mode
    if (type(mode) is not int and not _is_int(mode)) or mode not in CUDAGRAPH_MODES:
        raise InvalidReport(rank, "cudagraph_mode", mode, "0, 1 or 2")
    if (
        type(report.want_ubatch) is not bool
        or type(report.has_unfinished) is not bool
        or type(report.want_pause) is not bool
    ):
        for name in _FLAGS:
            value = getattr(report, name)
            if type(value) is not bool:
                raise InvalidReport(rank, name, value, "True or False")


def check_carriable(rank: int, report: StepReport) -> None:
    """Raise `InvalidReport` for what the wire cannot carry at all (a count or mode that is not
    an int in int64, a flag that is not a bool): the client checks this before sending, taking
    no seq. A value the wire carries but the policy refuses (2**31 tokens, mode 7) is sent, so
    that coordd fails the round for every rank, naming this one, instead of leaving the others
    to wait for a report that never comes."""
    # The common case first, exact ints and bools in one expression (half the cost of the
    # field loop below, on every report); tests/unit/test_rules_once.py pins it to the loop.
    tokens, padded, mode = report.num_tokens, report.num_tokens_padded, report.cudagraph_mode
    if (
        type(tokens) is int
        and type(padded) is int
        and type(mode) is int
        and INT64_MIN <= tokens <= INT64_MAX
        and INT64_MIN <= padded <= INT64_MAX
        and INT64_MIN <= mode <= INT64_MAX
        and type(report.want_ubatch) is bool
        and type(report.has_unfinished) is bool
        and type(report.want_pause) is bool
    ):
        return
    _check_carriable_fields(rank, report)


def _check_carriable_fields(rank: int, report: StepReport) -> None:
    """`check_carriable`'s rule field by field, naming the first that breaks it."""
    for name in _COUNTS:
        value = getattr(report, name)
        if type(value) is not int and not _is_int(value):
            raise InvalidReport(rank, name, value, f"an int in 0..{MAX_TOKENS}")
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidReport(rank, name, value, f"0..{MAX_TOKENS} ({_INT32})")
    for name in _FLAGS:
        value = getattr(report, name)
        if type(value) is not bool:
            raise InvalidReport(rank, name, value, "True or False")


def _is_int(value: object) -> bool:
    """An int the wire carries as one (an IntEnum member, say), not a bool."""
    return isinstance(value, int) and type(value) is not bool


def validate_gather(
    rank: int, report: GatherReport, dp_size: int, first: GatherReport | None
) -> None:
    """Raise `InvalidReport` if `report`'s values differ in number from `first` (the round's
    first report; None: `report` opens the round) or would not fit in one result frame."""
    count = len(report.values)
    if first is not None:
        expected = len(first.values)
        if count != expected:
            raise InvalidReport(
                rank, "values", count, f"{expected} values, as the round's first report"
            )
        return
    limit = max_gather_values(dp_size)
    if count > limit:
        raise InvalidReport(
            rank, "values", count, f"at most {limit} values at dp={dp_size} (one 64 KiB frame)"
        )


def last_ubatch_empty(max_padded: int, min_tokens: int, num_ubatches: int) -> bool:
    """Split the padded batch in `num_ubatches`: is the smallest rank's last one empty?"""
    return (max_padded // num_ubatches) * (num_ubatches - 1) >= min_tokens


def decide(
    reports: Sequence[StepReport | None],
    num_ubatches: int = 2,
    *,
    epoch: int = 0,
    seq: int = 0,
    kind: StepKind = StepKind.FORWARD,
) -> StepDecision:
    """Apply the agreement rules to one report per rank (index = dp rank).

    `None` stands for a dead rank (elastic mode): it never lowers the minimum, never vetoes
    micro-batching, never raises the maximum, and is listed in `dead_ranks`.
    """
    # One pass over the reports (it runs once per round in coordd, on every rank on the
    # device path): the max, the mins, the ANDs and the OR of the rules below.
    live = 0
    dead_ranks: list[int] = []
    max_padded = min_tokens = cudagraph_mode = 0
    all_ubatch = all_idle = all_pause = True
    any_unfinished = any_pause = False
    for rank, r in enumerate(reports):
        if r is None:
            dead_ranks.append(rank)
            continue
        padded, tokens, mode = r.num_tokens_padded, r.num_tokens, r.cudagraph_mode
        if live:
            if padded > max_padded:
                max_padded = padded
            if tokens < min_tokens:
                min_tokens = tokens
            if mode < cudagraph_mode:
                cudagraph_mode = mode
        else:
            max_padded, min_tokens, cudagraph_mode = padded, tokens, mode
        live += 1
        if not r.want_ubatch:
            all_ubatch = False
        if tokens != 0:
            all_idle = False
        if r.has_unfinished:
            any_unfinished = True
        if r.want_pause:
            any_pause = True
        else:
            all_pause = False
    if not live:
        raise ValueError("decide() needs at least one live report")
    should_ubatch = all_ubatch and not last_ubatch_empty(max_padded, min_tokens, num_ubatches)
    should_pad = cudagraph_mode != 0 or should_ubatch
    if should_pad:
        across = [max_padded] * len(reports)
    elif dead_ranks:
        across = [0 if r is None else r.num_tokens_padded for r in reports]
    else:
        across = [r.num_tokens_padded for r in reports]  # type: ignore[union-attr]
    return StepDecision(
        epoch=epoch,
        seq=seq,
        kind=kind,
        num_tokens_across_dp=across,
        should_ubatch=should_ubatch,
        should_pad=should_pad,
        cudagraph_mode=cudagraph_mode,
        any_unfinished=any_unfinished,
        all_idle=all_idle,
        dead_ranks=dead_ranks,
        should_pause=all_pause,
        any_pause=any_pause,
    )


def decision_misfit(
    decision: StepDecision,
    sent: StepReport,
    dp_rank: int,
    dp_size: int,
    kind: StepKind | None = None,
) -> InvalidAnswer | None:
    """None if `decision` can be what `decide` made of a round in which this rank (`dp_rank`)
    sent `sent` (as a round of `kind`; None: `sent.kind`); else the `InvalidAnswer` (coordd at
    fault) naming the first field that contradicts it. A rank sees only its own report, so
    these are the rules it can check:

    - the round's kind; `num_tokens_across_dp` of length dp, every count in 0..MAX_TOKENS;
    - `cudagraph_mode` in 0..2 and no higher than this rank's (the min over ranks);
    - `should_pad` is `cudagraph_mode != 0 or should_ubatch`; padded, every entry is one
      count, at least this rank's `num_tokens_padded` (the max); unpadded, this rank's entry
      is its own `num_tokens_padded`;
    - `should_ubatch` only if this rank wanted it; `any_unfinished` if this rank has
      unfinished requests; `all_idle` only if this rank ran no tokens; `should_pause` only if
      this rank wants to pause, and `any_pause` if it does (or if `should_pause`);
    - `dead_ranks` within 0..dp-1, and never this rank (it reported).

    Cheap (comparisons, and one pass over the counts): every decision comes here, so no
    call the rules do not need (the highest mode is a constant, the round's seq is read only
    for an error); tests/unit/test_answer_checks.py pins it to the rules as first written."""
    asked = sent.kind if kind is None else kind
    if decision.kind is not asked:
        return InvalidAnswer(decision.seq, "kind", decision.kind.value, asked.value)
    across = decision.num_tokens_across_dp
    if len(across) != dp_size:
        return InvalidAnswer(
            decision.seq, "num_tokens_across_dp", across, f"{dp_size} values, one per rank"
        )
    mode = decision.cudagraph_mode
    if not 0 <= mode <= _MAX_MODE or mode > sent.cudagraph_mode:
        return InvalidAnswer(
            decision.seq,
            "cudagraph_mode",
            mode,
            f"0..{min(sent.cudagraph_mode, _MAX_MODE)} (the min over ranks; this "
            f"rank reported {sent.cudagraph_mode})",
        )
    ubatch = decision.should_ubatch
    if ubatch and not sent.want_ubatch:
        return InvalidAnswer(
            decision.seq, "should_ubatch", True, "False: this rank did not want it"
        )
    pad = decision.should_pad
    if pad != (mode != 0 or ubatch):
        return InvalidAnswer(
            decision.seq, "should_pad", pad, "cudagraph_mode != 0 or should_ubatch"
        )
    own = across[dp_rank]
    padded = sent.num_tokens_padded
    if pad:
        if not padded <= own <= MAX_TOKENS or across.count(own) != dp_size:
            return InvalidAnswer(
                decision.seq,
                "num_tokens_across_dp",
                across,
                f"one count for every rank (padded), in {padded}..{MAX_TOKENS} (this rank's "
                f"num_tokens_padded is {padded})",
            )
    elif own != padded:
        return InvalidAnswer(
            decision.seq,
            f"num_tokens_across_dp[{dp_rank}]",
            own,
            f"{padded} (what this rank reported)",
        )
    elif min(across) < 0 or max(across) > MAX_TOKENS:
        return InvalidAnswer(
            decision.seq, "num_tokens_across_dp", across, f"counts in 0..{MAX_TOKENS}"
        )
    if sent.has_unfinished and not decision.any_unfinished:
        return InvalidAnswer(
            decision.seq, "any_unfinished", False, "True: this rank has unfinished requests"
        )
    if decision.all_idle and sent.num_tokens != 0:
        return InvalidAnswer(
            decision.seq, "all_idle", True, f"False: this rank runs {sent.num_tokens} tokens"
        )
    pause = decision.should_pause
    if pause and not sent.want_pause:
        return InvalidAnswer(
            decision.seq, "should_pause", True, "False: this rank does not want to pause"
        )
    if (pause or sent.want_pause) and not decision.any_pause:
        return InvalidAnswer(decision.seq, "any_pause", False, "True: this rank wants to pause")
    dead = decision.dead_ranks
    if dead:
        if min(dead) < 0 or max(dead) >= dp_size:
            return InvalidAnswer(decision.seq, "dead_ranks", dead, f"ranks in 0..{dp_size - 1}")
        if dp_rank in dead:
            return InvalidAnswer(
                decision.seq, "dead_ranks", dead, f"not this rank ({dp_rank}): it reported"
            )
    return None


def gather_misfit(
    result: GatherResult, sent: GatherReport, dp_rank: int, dp_size: int
) -> InvalidAnswer | None:
    """None if `result` can be the rows of a gather round in which this rank (`dp_rank`) sent
    `sent`; else the `InvalidAnswer` naming the first thing that contradicts it: the site,
    dp rows, `dead_ranks` within 0..dp-1 and never this rank, this rank's own row as sent,
    every live row as long as it and every dead rank's row empty."""
    seq = result.seq
    if result.site != sent.site:
        return InvalidAnswer(seq, "site", result.site, repr(sent.site))
    rows = result.rows
    if len(rows) != dp_size:
        return InvalidAnswer(seq, "rows", f"{len(rows)} rows", f"{dp_size} rows, one per rank")
    dead = result.dead_ranks
    if dead:
        if min(dead) < 0 or max(dead) >= dp_size:
            return InvalidAnswer(seq, "dead_ranks", dead, f"ranks in 0..{dp_size - 1}")
        if dp_rank in dead:
            return InvalidAnswer(seq, "dead_ranks", dead, f"not this rank ({dp_rank}): it reported")
    values = sent.values
    if rows[dp_rank] != values:
        return InvalidAnswer(
            seq, f"rows[{dp_rank}]", rows[dp_rank], f"{values} (what this rank sent)"
        )
    if not dead and len(set(map(len, rows))) == 1:  # every row as long as this rank's
        return None
    want = len(values)
    for r, row in enumerate(rows):
        length = 0 if r in dead else want
        if len(row) != length:
            return InvalidAnswer(
                seq, f"rows[{r}]", f"{len(row)} values", f"{length} (rank {r}'s row)"
            )
    return None
