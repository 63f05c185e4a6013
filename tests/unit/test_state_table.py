"""The group's state table is written once as data (`TRANSITIONS`); the table in
group_state's docstring, which says what each move means, must list exactly those moves."""

from __future__ import annotations

import re

from coordd.proto import group_state
from coordd.proto.group_state import TRANSITIONS, GroupEvent, GroupState

ROW = re.compile(r"^\s{4}([A-Z_]+)\s+([A-Z_]+)\s+([A-Z_]+)\s{2,}\S")


def documented_moves(text: str) -> set[tuple[str, str, str]]:
    """(state, event, next state) of every row of a docstring's table."""
    rows = (ROW.match(line) for line in text.splitlines())
    return {(m[1], m[2], m[3]) for m in rows if m and m[1] != "state"}


def table_moves() -> set[tuple[str, str, str]]:
    return {
        (state.name, event.name, after.name)
        for state, moves in TRANSITIONS.items()
        for event, after in moves.items()
    }


def test_the_docstring_lists_every_legal_move_and_no_other() -> None:
    documented = documented_moves(group_state.__doc__ or "")
    assert documented, "no table found in coordd.proto.group_state's docstring"
    assert documented == table_moves(), (
        f"in the docstring only: {sorted(documented - table_moves())}; "
        f"in TRANSITIONS only: {sorted(table_moves() - documented)}"
    )


def test_the_reader_sees_a_changed_row() -> None:
    """The check can fail: a row whose next state differs is told apart."""
    doc = group_state.__doc__ or ""
    changed = doc.replace("IDLE         OPEN     ROUND_OPEN", "IDLE         OPEN     FAILED    ")
    assert changed != doc
    assert documented_moves(changed) != table_moves()


def test_every_state_and_event_appears_in_the_table() -> None:
    moves = table_moves()
    assert {s for s, _, _ in moves} | {n for _, _, n in moves} == {s.name for s in GroupState}
    assert {e for _, e, _ in moves} == {e.name for e in GroupEvent}
