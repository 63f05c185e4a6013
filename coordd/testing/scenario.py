"""What the history checker holds one scenario's histories to, as plain data.

A harness (coordd's chaos runner, or an engine team's own test) fills a `ScenarioInfo` for each
fault it injects; the checker reads nothing else of the harness, so any harness can use it.
"""

from __future__ import annotations

import msgspec


class Expect(msgspec.Struct, frozen=True, kw_only=True):
    """What the history of one scenario must show."""

    #: The group must see a typed failure (every live rank, after the injection).
    failure: bool = False
    #: Error types the group may see after the injection (anything else is a violation).
    errors: list[str] = []
    #: ...and those errors must name the culprit rank.
    names_culprit: bool = True
    #: The culprit process's own view: "same" as the group's, "any" typed error, "gone".
    culprit_view: str = "same"
    #: The culprit process must itself get a typed error after the injection.
    culprit_must_fail: bool = False
    #: The culprit process must be refused with this error ("Rejected:dp_size", "ProtocolError"),
    #: or pass the named hostile peer's checks ("rogue", "stranger", "takeover", "id_claims",
    #: "junk_groups"; "forged_answer": the culprit rank is the one handed a forged answer).
    refusal: str = ""
    #: coordd crashed (SIGKILL): a round's broadcast may reach some ranks and not others.
    split_allowed: bool = False
    #: Wrong kind: coordd names the culprit by the round's evidence (the majority kind, ties
    #: going to the lowest rank's), whoever reported first. With no majority (dp=2, the culprit
    #: rank 0) the tie makes the culprit's kind the round's, and the mismatch names the other
    #: rank: accepted then (only then) when its fields show the injected kind as expected.
    mirror_ok: bool = False


class ScenarioInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One scenario as the checker sees it: the fault, its culprit, the bounds, the expectation."""

    fault: str
    seed: int
    dp: int
    transport: str
    #: The rank the fault is injected into (-1: none, e.g. coordd itself).
    culprit: int
    #: The history name (`Header.name`) of the culprit process.
    culprit_name: str
    expect: Expect
    #: How long a rank waits on its own before it calls a round a hang, seconds.
    wait_timeout: float
    #: Every rank must see the failure within this long of the injection, seconds.
    detection_bound: float
    inject_seq: int = -1
    end_seq: int = -1
    #: Processes the harness killed on purpose (not hangs, not expected to finish).
    harness_kills: list[str] = []
    #: An `InvalidReport` the fault explains must name this report field ("": any).
    culprit_field: str = ""
    skipped: str = ""
    #: Rank processes whose own view counts as the culprit's (`Expect.culprit_view`): the
    #: ranks behind a relay that is the fault (the culprit rank is the relay's lowest).
    also_culprits: list[str] = []
