"""coordd.core._settings.ServerSettings: the one value `coordd serve` builds, frozen and checked."""

from __future__ import annotations

import dataclasses

import pytest

from coordd.core import _daemon_defaults as defaults
from coordd.core._settings import ServerSettings


def test_settings_are_frozen_with_the_daemon_defaults() -> None:
    settings = ServerSettings("ipc:///tmp/x.sock", dp_size=4)
    assert settings.groups == defaults.DEFAULT_GROUPS
    assert settings.max_groups == defaults.DEFAULT_MAX_GROUPS
    assert settings.stranger_grace == defaults.STRANGER_GRACE
    assert not settings.gated and settings.expected_count == 0 and settings.expected_names == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.dp_size = 8  # type: ignore[misc]


def test_lists_from_the_command_line_become_tuples_and_names_count() -> None:
    settings = ServerSettings(
        "ipc:///tmp/x.sock", dp_size=2, groups=["a", "b*"], expect_groups=["a"],  # type: ignore[arg-type]
        max_rss_mb=64,
    )
    assert settings.groups == ("a", "b*") and settings.expect_groups == ("a",)
    assert settings.expected_names == ("a",) and settings.expected_count == 1 and settings.gated
    hash(settings)  # a value: usable as a key


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dp_size": 0}, r"dp_size must be in 1\.\."),
        ({"dp_size": 2, "max_groups": 0}, "max_groups must be >= 1"),
        (
            {"dp_size": 2, "max_groups": 2, "expect_groups": 3},
            r"expect_groups must be in 0\.\.max_groups \(2\)",
        ),
    ],
)
def test_out_of_range_settings_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerSettings("ipc:///tmp/x.sock", **kw)  # type: ignore[arg-type]


def test_expecting_every_group_the_limit_allows_is_a_valid_setting() -> None:
    """Planted (issue 36, item 5): a range check refusing expect_groups == max_groups
    survived every test."""
    settings = ServerSettings("ipc:///tmp/x.sock", dp_size=2, max_groups=3, expect_groups=3)
    assert (settings.max_groups, settings.expect_groups) == (3, 3)
    assert ServerSettings("ipc:///tmp/x.sock", dp_size=2, max_groups=3, expect_groups=0)
