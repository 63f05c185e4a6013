"""The ranges of coordd's options, checked before anything starts (`coordd serve`, and the
demo's, the chaos runner's and the benchmark's own), each refusal one sentence that names the
option, the value and the range.

Times are seconds, finite and positive, and within what libzmq's millisecond options hold;
counts are whole numbers in their range. `coordd.cli._checks.check_serve` holds every rule
of `coordd serve`.
"""

from __future__ import annotations

import math

from coordd.proto.messages import MAX_DP_SIZE

#: Longest a round may stay open, and the longest heartbeat setting: a day (libzmq takes the
#: heartbeat in int milliseconds; past ~24 days it would wrap).
MAX_SECONDS = 86_400.0
#: Shortest heartbeat setting libzmq can apply (it takes milliseconds; 0 turns it off).
MIN_HEARTBEAT = 0.001


class OptionError(ValueError):
    """An option outside its range; the message names it, the value and the range."""


def seconds(option: str, value: float, *, low: float, high: float = MAX_SECONDS) -> float:
    """`value` if it is a finite number of seconds in [low, high], else `OptionError`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise OptionError(f"{option} must be a number of seconds, got {value!r}")
    if not low <= value <= high:
        raise OptionError(f"{option} must be in {low:g}..{high:g} seconds, got {value:g}")
    return float(value)


def count(option: str, value: int, *, low: int, high: int | None = None) -> int:
    """`value` if it is a whole number in [low, high], else `OptionError`."""
    if type(value) is not int:
        raise OptionError(f"{option} must be a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise OptionError(f"{option} must be {bound}, got {value}")
    return value


def dp_size(option: str, value: int, *, low: int = 1) -> int:
    """A dp size: `low`..MAX_DP_SIZE (the most ranks a decision's frame and every client's
    decoder hold)."""
    try:
        return count(option, value, low=low, high=MAX_DP_SIZE)
    except OptionError:
        raise OptionError(
            f"{option} must be {low}..{MAX_DP_SIZE} (the most ranks coordd's messages carry), "
            f"got {value!r}"
        ) from None


def heartbeats(interval: float, timeout: float, prefix: str = "--heartbeat") -> None:
    """The ZMTP heartbeat pair: each 1 ms..a day; the timeout at least the interval (a peer is
    declared lost only after it had the chance to answer one PING)."""
    seconds(f"{prefix}-interval", interval, low=MIN_HEARTBEAT)
    seconds(f"{prefix}-timeout", timeout, low=MIN_HEARTBEAT)
    if timeout < interval:
        raise OptionError(
            f"{prefix}-timeout ({timeout:g}s) must be at least {prefix}-interval ({interval:g}s)"
        )


def rss_mb(value: int) -> int:
    """`--max-rss-mb`: 0 (off) or MIN_RSS_MB..MAX_RSS_MB (below MIN_RSS_MB a quiet coordd is
    already over it, and every connecting rank would be closed)."""
    from coordd.core._daemon_defaults import MAX_RSS_MB, MIN_RSS_MB

    if type(value) is int and (value == 0 or MIN_RSS_MB <= value <= MAX_RSS_MB):
        return value
    raise OptionError(
        f"--max-rss-mb must be 0 (off) or {MIN_RSS_MB}..{MAX_RSS_MB} MB, got {value!r}"
    )


def handshake_rate(value: float) -> float:
    """`--max-handshake-rate`: 0 (off) or 1..1,000,000 a second (under 1, one source's
    share admits no connection for seconds)."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value == 0 or 1 <= value <= 1_000_000)
    ):
        return value
    raise OptionError(
        f"--max-handshake-rate must be 0 (off) or 1..1000000 connections a second, got {value!r}"
    )


def group_patterns(patterns: list[str]) -> list[str]:
    """`--groups`: at least one name or pattern, each one a valid group name."""
    from coordd.core._group_names import MAX_GROUP_NAME, group_name_problem, shown

    if not patterns:
        raise OptionError("--groups must name at least one group (or pattern; '*': any)")
    for pattern in patterns:
        problem = group_name_problem(pattern)
        if problem is not None:
            raise OptionError(
                f"--groups entry {shown(pattern)} cannot name a group ({problem}): each is "
                f"1..{MAX_GROUP_NAME} printable characters without whitespace"
            )
    return patterns


def expected_groups(value: object, groups: list[str], max_groups: int) -> None:
    """`--expect-groups`: a count in 0..--max-groups, or names --groups admits."""
    from coordd.core._group_names import GroupRules, group_name_problem, shown

    if type(value) is int:
        if not 0 <= value <= max_groups:
            raise OptionError(
                f"--expect-groups must be in 0..--max-groups ({max_groups}), got {value}"
            )
        return
    if not isinstance(value, list) or not value:
        raise OptionError("--expect-groups takes a count or a comma list of group names, got none")
    rules = GroupRules(groups)
    for name in value:
        problem = group_name_problem(name)
        if problem is not None:
            raise OptionError(
                f"--expect-groups entry {shown(name)} cannot name a group ({problem})"
            )
        if not rules.admits(name):
            raise OptionError(
                f"--expect-groups names {name!r}, which --groups ({rules}) does not admit"
            )
