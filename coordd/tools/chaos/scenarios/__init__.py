"""The fault kinds: for each, how it is injected into a running group and what must come of it.

Every scenario starts a real coordd and `dp` rank processes (2..4, from the seed), lets them run
rounds, injects its one fault at a seeded point and, where the group fails, lets it recover:
the ranks register again (a new epoch) and run on to the end, and a rank that is gone (killed,
or refused at the door) is replaced as a supervisor would. `Expect` is what the checker holds
the history to; the runner writes it into each scenario's `scenario.json`.
"""

from __future__ import annotations

from coordd.testing.scenario import Expect
from coordd.tools.chaos.scenario_run import Scenario
from coordd.tools.chaos.scenarios.fallback import (
    CoorddBackFallback,
    CoorddFlapping,
    CoorddLostFallback,
    CoorddPartialAnswer,
)
from coordd.tools.chaos.scenarios.hostile_peers import (
    ForgedAnswers,
    GarbageFrames,
    IdClaims,
    JunkGroups,
    StrangerNoise,
    TakeoverAttempt,
)
from coordd.tools.chaos.scenarios.outages import CoorddRestart, NetworkCut
from coordd.tools.chaos.scenarios.rank_faults import (
    AbandonedRound,
    ClientMisuse,
    DuplicateRank,
    InvalidValue,
    JoinMismatch,
    RankKilled,
    RankPaused,
    RawFault,
    Straggler,
    WrongKind,
)
from coordd.tools.chaos.scenarios.relays import RelayCut, RelayKilled, RelayPaused
from coordd.tools.chaos.spec import Fault

_MISMATCH = Expect(failure=True, errors=["StepMismatch"])

SCENARIOS: dict[Fault, Scenario] = {
    s.fault: s
    for s in [
        RawFault(Fault.SKIPPED_SEQ, "a rank skips a sync (reports seq + 1)", _MISMATCH),
        RawFault(Fault.REPEATED_SEQ, "a rank re-sends an earlier seq with other data", _MISMATCH),
        WrongKind(
            Fault.WRONG_KIND,
            "a rank reports forward where the round is a drafter step (first or last)",
            Expect(failure=True, errors=["StepMismatch"], mirror_ok=True),
        ),
        RawFault(
            Fault.CONFLICTING_DUPLICATE,
            "a rank sends two different reports for one round",
            Expect(failure=True, errors=["ConflictingReport", "StepMismatch"]),
        ),
        JoinMismatch(
            Fault.DP_SIZE_MISMATCH, "a rank joins with another dp_size", "dp_size", "dp_size"
        ),
        JoinMismatch(
            Fault.FINGERPRINT_MISMATCH,
            "a rank joins with another config",
            "config_fingerprint",
            "fingerprint",
        ),
        JoinMismatch(
            Fault.VERSION_MISMATCH,
            "a rank speaks another protocol version",
            "protocol_version",
            "version",
        ),
        DuplicateRank(),
        RankKilled(),
        RankPaused(),
        Straggler(),
        CoorddRestart(),
        GarbageFrames(),
        RawFault(
            Fault.SPOOFED_RANK,
            "a rank registered as r reports as another rank",
            Expect(refusal="ProtocolError", culprit_view="same"),
        ),
        NetworkCut(),
        InvalidValue(),
        ClientMisuse(),
        StrangerNoise(),
        TakeoverAttempt(),
        IdClaims(),
        JunkGroups(),
        ForgedAnswers(),
        AbandonedRound(),
        RelayKilled(),
        RelayPaused(),
        RelayCut(),
        CoorddLostFallback(),
        CoorddBackFallback(),
        CoorddFlapping(),
        CoorddPartialAnswer(),
    ]
}
assert set(SCENARIOS) == set(Fault), "one scenario per fault kind"

__all__ = ["SCENARIOS"]
