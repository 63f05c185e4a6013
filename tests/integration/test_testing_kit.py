"""coordd.testing as an engine team would use it: a real coordd, a rank that misbehaves on the
wire, a rogue peer, histories written by hand and judged by the checker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import coordd.testing
from coordd.proto import CoordError, StepDecision, StepKind, StepMismatch, StepReport
from coordd.testing import (
    Begin,
    CoorddProcess,
    Done,
    End,
    Expect,
    HistoryWriter,
    Inject,
    ProcessLog,
    RawRank,
    Refused,
    Registered,
    RoguePeer,
    ScenarioInfo,
    check_history,
    decision_dict,
    error_info,
    read_history,
    report_dict,
)

REPORT = StepReport(num_tokens=8, num_tokens_padded=8, has_unfinished=True)
TIMEOUT = 10.0


def test_the_public_names_are_all_importable() -> None:
    assert all(hasattr(coordd.testing, name) for name in coordd.testing.__all__)


@pytest.fixture
def coordd_process(tmp_path: Path) -> Iterator[CoorddProcess]:
    with CoorddProcess(2, f"ipc://{tmp_path}/c.sock", ["--log-level", "warning"]) as proc:
        yield proc


def _send(rank: RawRank, log: HistoryWriter, *, skip: bool = False) -> int:
    """Report the rank's next round (`skip`: stamped one seq ahead), logged as `Begin`."""
    seq = rank.next_seq
    stamped = rank.stamp(REPORT, StepKind.FORWARD, seq=seq + 1 if skip else None)
    assert rank.epoch is not None
    log.write(
        Begin(t=time.monotonic(), epoch=rank.epoch, seq=seq, kind="forward",
              sent=[report_dict(stamped)])
    )
    rank.send(stamped)
    rank.advance()
    return seq


def _outcome(rank: RawRank, log: HistoryWriter, seq: int) -> StepDecision | CoordError:
    """Wait for the round's outcome, logged as `End` (a decision or the typed error)."""
    assert rank.epoch is not None
    epoch = rank.epoch
    try:
        decision = rank.wait(seq, TIMEOUT)
    except CoordError as error:
        log.write(End(t=time.monotonic(), epoch=epoch, seq=seq, error=error_info(error)))
        return error
    log.write(End(t=time.monotonic(), epoch=epoch, seq=seq, decision=decision_dict(decision)))
    return decision


def test_a_rank_that_skips_a_seq_fails_the_round_for_all_and_the_checker_agrees(
    coordd_process: CoorddProcess, tmp_path: Path
) -> None:
    paths = [str(tmp_path / f"rank{r}.jsonl") for r in range(2)]
    logs = [
        HistoryWriter(paths[0], role="rank", rank=0, name="rank0"),
        HistoryWriter(paths[1], role="raw", rank=1, name="rank1"),
    ]
    ranks = [RawRank(coordd_process.address, dp_rank=r, dp_size=2) for r in range(2)]
    pairs = list(zip(ranks, logs, strict=True))
    try:
        for rank, log in pairs:
            welcome = rank.register(TIMEOUT)
            log.write(Registered(t=time.monotonic(), epoch=welcome.epoch, next_seq=0))
        seqs = [_send(rank, log) for rank, log in pairs]
        decided = [_outcome(rank, log, seq) for (rank, log), seq in zip(pairs, seqs, strict=True)]
        assert isinstance(decided[0], StepDecision) and decided[0] == decided[1]
        logs[1].write(Inject(t=time.monotonic(), fault="skipped_seq", rank=1))
        seqs = [_send(ranks[0], logs[0]), _send(ranks[1], logs[1], skip=True)]
        failed = [_outcome(rank, log, seq) for (rank, log), seq in zip(pairs, seqs, strict=True)]
        assert all(isinstance(error, StepMismatch) for error in failed), failed
        for rank, log in pairs:
            log.write(Done(t=time.monotonic(), next_seq=rank.next_seq))
    finally:
        for rank in ranks:
            rank.close()
        for log in logs:
            log.close()

    histories = []
    for path in paths:
        header, records = read_history(path)
        assert header is not None
        histories.append(ProcessLog(header.name, header, records))
    info = ScenarioInfo(
        fault="skipped_seq",
        seed=0,
        dp=2,
        transport="ipc",
        culprit=1,
        culprit_name="rank1",
        expect=Expect(failure=True, errors=["StepMismatch"]),
        wait_timeout=TIMEOUT,
        detection_bound=TIMEOUT,
    )
    result = check_history(info, histories, runner=[])
    assert result.ok and result.detected, result.violations
    assert (result.rounds, result.failed_rounds) == (1, 1)


def test_a_rogue_peer_floods_coordd_which_drops_it_all_and_refuses_the_stranger(
    coordd_process: CoorddProcess, tmp_path: Path
) -> None:
    path = str(tmp_path / "rogue.jsonl")
    log = HistoryWriter(path, role="garbage", rank=-1, name="rogue")
    with RoguePeer(coordd_process.address, dp_size=2, seed=1) as rogue:
        assert rogue.connected(timeout=TIMEOUT)
        sent = rogue.flood(16)
        rogue.probe(log, timeout=TIMEOUT)
    log.close()
    assert sum(sent.values()) == 16 and set(sent) == set(coordd.testing.CATEGORIES)
    _, records = read_history(path)
    assert [r.what for r in records if not isinstance(r, Refused)] == ["pong"]
    refused = {r.what: r.error for r in records if isinstance(r, Refused)}
    assert refused["hello"].reason == "rank_range"
    assert "stranger report" in refused

    ranks = [RawRank(coordd_process.address, dp_rank=r, dp_size=2) for r in range(2)]
    try:  # the group still forms and decides
        for rank in ranks:
            rank.register(TIMEOUT)
        for rank in ranks:
            rank.send(rank.stamp(REPORT, StepKind.FORWARD))
            rank.advance()
        assert ranks[0].wait(0, TIMEOUT) == ranks[1].wait(0, TIMEOUT)
    finally:
        for rank in ranks:
            rank.close()
