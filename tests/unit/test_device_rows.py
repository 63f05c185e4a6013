"""The device path's pure parts: the step matrix, the handshake, and choosing the path.

The gathered matrix is what every rank sees after the all-reduce, so resolving it here is
exactly what every rank does; the gloo runs are in tests/integration/test_device_path.py.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from coordd.client._factory import DEVICE_PATH_ENV, connect_coordinator, device_path_enabled
from coordd.client.device import (
    HELLO_BYTES,
    KIND_CODES,
    Field,
    admit,
    decode_hellos,
    encode_hello_row,
    encode_row,
    fingerprint_hash,
    resolve_round,
)
from coordd.client.dp_coordination import dp_state, state_report
from coordd.client.sync import CoordClient
from coordd.proto.coordinator import Coordinator
from coordd.proto.errors import InvalidReport, ProtocolError, Rejected, StepMismatch
from coordd.proto.messages import (
    POLICY_KINDS,
    Hello,
    Reject,
    StepKind,
    StepReport,
    decode_from_coordinator,
    encode,
    error_from_failure,
    error_from_reject,
    failure_message,
)
from coordd.proto.policy import decide

FP = "fp"


def hellos(n: int, **overrides: dict[str, object]) -> list[Hello]:
    out = []
    for r in range(n):
        fields: dict[str, object] = dict(dp_size=n, dp_rank=r, config_fingerprint=FP,
                                         incarnation=f"i{r}")
        fields.update(overrides.get(str(r), {}))
        out.append(Hello(**fields))  # type: ignore[arg-type]
    return out


def rows_for(reports: list[StepReport], seq: int, kinds: list[StepKind] | None = None,
             seqs: list[int] | None = None) -> list[list[int]]:
    kinds = kinds or [StepKind.FORWARD] * len(reports)
    seqs = seqs or [seq] * len(reports)
    return [
        encode_row(StepReport(**{**_fields(r), "seq": s, "kind": k, "dp_rank": i}),
                   fingerprint_hash(FP), 2)
        for i, (r, k, s) in enumerate(zip(reports, kinds, seqs, strict=True))
    ]


def _fields(report: StepReport) -> dict[str, object]:
    return {f: getattr(report, f) for f in report.__struct_fields__}


reports_st = st.builds(
    lambda n, extra, ub, cg, unf, pause: StepReport(
        num_tokens=n, num_tokens_padded=n + extra, want_ubatch=ub, cudagraph_mode=cg,
        has_unfinished=unf, want_pause=pause),
    st.integers(0, 10_000), st.integers(0, 512), st.booleans(), st.integers(0, 2),
    st.booleans(), st.booleans(),
)


@given(st.lists(reports_st, min_size=1, max_size=16), st.integers(0, 2**40),
       st.sampled_from(POLICY_KINDS), st.integers(1, 4))
def test_the_matrix_resolves_to_the_policy_decision(reports, seq, kind, num_ubatches) -> None:
    hs = hellos(len(reports), **{str(r): {"num_ubatches": num_ubatches}
                                 for r in range(len(reports))})
    rows = [
        encode_row(StepReport(**{**_fields(r), "seq": seq, "kind": kind}),
                   fingerprint_hash(FP), num_ubatches)
        for r in reports
    ]
    got = resolve_round(rows, seq=seq, hellos=hs)
    assert got == decide(reports, num_ubatches, epoch=0, seq=seq, kind=kind)


REPORT = StepReport(num_tokens=3, num_tokens_padded=8, want_ubatch=True, cudagraph_mode=2)


def test_a_skipped_seq_names_the_rank_off_the_shared_sequence() -> None:
    rows = rows_for([REPORT] * 4, 7, seqs=[7, 7, 8, 7])
    with pytest.raises(StepMismatch) as err:
        resolve_round(rows, seq=7, hellos=hellos(4))
    assert err.value == StepMismatch(2, 7, "forward", 8, "forward")


def test_the_kind_most_ranks_report_is_expected_and_a_tie_goes_to_the_lowest_rank() -> None:
    f, d = StepKind.FORWARD, StepKind.DRAFT
    with pytest.raises(StepMismatch) as err:
        resolve_round(rows_for([REPORT] * 4, 0, kinds=[d, f, f, f]), seq=0, hellos=hellos(4))
    assert err.value == StepMismatch(0, 0, "forward", 0, "draft")
    with pytest.raises(StepMismatch) as err:
        resolve_round(rows_for([REPORT] * 2, 0, kinds=[d, f]), seq=0, hellos=hellos(2))
    assert err.value == StepMismatch(1, 0, "draft", 0, "forward")


def test_an_invalid_report_is_named_like_coordd_names_it() -> None:
    bad = StepReport(num_tokens=9, num_tokens_padded=4)
    with pytest.raises(InvalidReport) as err:
        resolve_round(rows_for([REPORT, REPORT, bad], 0), seq=0, hellos=hellos(3))
    assert err.value == InvalidReport(2, "num_tokens_padded", 4, ">= num_tokens (9)")


def test_the_device_error_equals_the_one_coordd_sends_over_the_wire() -> None:
    bad = StepReport(num_tokens=9, num_tokens_padded=4)
    with pytest.raises(InvalidReport) as err:
        resolve_round(rows_for([REPORT, bad], 0), seq=0, hellos=hellos(2))
    wire = failure_message(err.value, epoch=1, seq=0, kind=StepKind.FORWARD)
    assert wire.expected == ">= num_tokens (9)"
    assert error_from_failure(decode_from_coordinator(encode(wire))) == err.value


@pytest.mark.parametrize("bits", list(itertools.product([False, True], repeat=4)))
def test_a_state_round_on_the_matrix_answers_sync_dp_state(bits: tuple[bool, ...]) -> None:
    unfinished, pending = bits[:2], bits[2:]
    reports = [state_report(u, p) for u, p in zip(unfinished, pending, strict=True)]
    got = dp_state(resolve_round(rows_for(reports, 3, kinds=[StepKind.STATE] * 2), seq=3,
                                 hellos=hellos(2)))
    # vllm/config/parallel.py sync_dp_state: one SUM all-reduce of [has_unfinished, pause]
    assert got == (any(unfinished) or sum(pending) % 2 != 0, all(pending))


def test_a_row_carries_each_field_in_its_column() -> None:
    report = StepReport(num_tokens=3, num_tokens_padded=5, want_ubatch=True, cudagraph_mode=2,
                        has_unfinished=True, want_pause=True, seq=7, kind=StepKind.DRAFT)
    row = encode_row(report, fingerprint=11, num_ubatches=13)
    assert len(row) == len(Field)
    assert {f: row[f] for f in Field} == {
        Field.NUM_TOKENS: 3, Field.NUM_TOKENS_PADDED: 5, Field.WANT_UBATCH: 1,
        Field.CUDAGRAPH_MODE: 2, Field.HAS_UNFINISHED: 1, Field.WANT_PAUSE: 1, Field.SEQ: 7,
        Field.KIND: KIND_CODES[StepKind.DRAFT], Field.FINGERPRINT: 11, Field.NUM_UBATCHES: 13,
        Field.PRESENT: 1,
    }
    # every row with the same unknown kind code is still refused
    rows = rows_for([REPORT] * 2, 0)
    for r in rows:
        r[Field.KIND] = 99
    with pytest.raises(ProtocolError) as err:
        resolve_round(rows, seq=0, hellos=hellos(2))
    assert err.value.rank == 0


def test_a_row_nobody_wrote_or_a_bad_kind_code_is_a_protocol_error() -> None:
    rows = rows_for([REPORT] * 3, 0)
    rows[1] = [0] * len(Field)
    with pytest.raises(ProtocolError) as err:
        resolve_round(rows, seq=0, hellos=hellos(3))
    assert err.value.rank == 1
    rows = rows_for([REPORT] * 3, 0)
    rows[2][Field.KIND] = 99
    with pytest.raises(ProtocolError) as err:
        resolve_round(rows, seq=0, hellos=hellos(3))
    assert err.value.rank == 2


def test_a_row_with_another_config_is_rejected_with_coordds_reason_and_values() -> None:
    hs = hellos(3, **{"1": {"config_fingerprint": "other"}})
    rows = rows_for([REPORT] * 3, 0)
    rows[1][Field.FINGERPRINT] = fingerprint_hash("other")
    with pytest.raises(Rejected) as err:
        resolve_round(rows, seq=0, hellos=hs)
    assert err.value == Rejected(
        "fingerprint", "rank 1 has config_fingerprint='other', the group (rank 0) has 'fp'",
        expected="fp", got="other")
    rows = rows_for([REPORT] * 3, 0)
    rows[2][Field.NUM_UBATCHES] = 3
    with pytest.raises(Rejected) as err:
        resolve_round(rows, seq=0, hellos=hellos(3))
    assert (err.value.reason, err.value.expected, err.value.got) == ("num_ubatches", "2", "3")


def test_hellos_survive_the_handshake_matrix_and_are_admitted_by_coordds_rules() -> None:
    hs = hellos(4, **{"2": {"config_fingerprint": "x" * 256, "group": "é" * 256}})
    rows = [encode_hello_row(h) for h in hs]
    assert all(len(r) == HELLO_BYTES for r in rows)
    assert decode_hellos(rows) == hs
    # coordd, fed the same Hellos in rank order, refuses the same rank with the same error
    coordinator, want = Coordinator(4, epoch=0), None
    for r, h in enumerate(hs):
        for send in coordinator.receive(f"p{r}".encode(), h, 0.0):
            if want is None and type(send.message) is Reject:
                want = error_from_reject(send.message)
    assert want is not None and want.reason == "group"
    assert admit(hs) == want
    assert admit(hellos(4)) is None


def test_a_missing_or_foreign_hello_names_its_row() -> None:
    rows = [encode_hello_row(h) for h in hellos(3)]
    rows[1] = bytes(HELLO_BYTES)
    with pytest.raises(ProtocolError) as err:
        decode_hellos(rows)
    assert err.value.rank == 1
    rows = [encode_hello_row(h) for h in hellos(3)]
    rows[0], rows[2] = rows[2], rows[0]
    with pytest.raises(ProtocolError) as err:
        decode_hellos(rows)
    assert err.value.rank == 0


def test_the_fingerprint_hash_is_31_bits_and_stable() -> None:
    assert fingerprint_hash("fp") == fingerprint_hash("fp") != fingerprint_hash("fq")
    assert all(0 <= fingerprint_hash(str(i)) < 2**31 for i in range(1000))


# -- choosing the path ---------------------------------------------------------------------


def test_coordd_is_the_default_and_the_env_var_or_argument_chooses(monkeypatch) -> None:
    monkeypatch.delenv(DEVICE_PATH_ENV, raising=False)
    assert device_path_enabled() is False
    with connect_coordinator("ipc:///nonexistent/coordd.sock", dp_rank=0, dp_size=1) as c:
        assert isinstance(c, CoordClient)
    for raw, want in [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)]:
        monkeypatch.setenv(DEVICE_PATH_ENV, raw)
        assert device_path_enabled() is want
        assert device_path_enabled(not want) is (not want)  # the argument wins
    monkeypatch.setenv(DEVICE_PATH_ENV, "maybe")
    with pytest.raises(ValueError, match="COORDD_DEVICE_PATH='maybe'"):
        device_path_enabled()


def test_the_device_path_without_a_process_group_says_so(monkeypatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this test process")
    monkeypatch.setenv(DEVICE_PATH_ENV, "1")
    with pytest.raises(ValueError, match=r"initialized torch\.distributed process group"):
        connect_coordinator(dp_rank=0, dp_size=1)


def test_the_coordd_path_never_imports_torch() -> None:
    code = ("import sys, coordd.client; "
            "c = coordd.client.connect_coordinator('ipc:///nonexistent/x.sock', "
            "dp_rank=0, dp_size=1); "
            "c.close(); assert 'torch' not in sys.modules, 'torch was imported'")
    env = {**os.environ, DEVICE_PATH_ENV: "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
