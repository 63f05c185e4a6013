"""Group names: what may name a group, how one is shown, and which the deployment expects
(`GroupRules`: `--groups` names and fnmatch patterns)."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from coordd.core._daemon_defaults import DEFAULT_GROUPS

#: Longest group name; names are printable and hold no whitespace (they are metric labels and
#: log fields).
MAX_GROUP_NAME = 64


def group_name_problem(name: str) -> str | None:
    """Why `name` cannot name a group, or None if it can."""
    if not 1 <= len(name) <= MAX_GROUP_NAME:
        return f"it has {len(name)} characters"
    for char in name:
        if char.isspace() or not char.isprintable():
            return f"it holds {char!r}"
    return None


def shown(name: str) -> str:
    """A group name as logs and answers show it: itself when valid, else its ascii() (cut)."""
    if group_name_problem(name) is None:
        return name
    return ascii(name[: MAX_GROUP_NAME + 1])


_GLOB = frozenset("*?[")


class GroupRules:
    """The groups a deployment expects: exact names and fnmatch patterns (`--groups`).
    `"*"` admits any valid name (the explicit rule for a deployment that names its own).
    `always`: names the patterns admit that also get a slot each (`--expect-groups` names: a
    peer's pattern-admitted junk groups cannot take the slots of the groups /readyz waits for)."""

    def __init__(
        self, patterns: Iterable[str] = DEFAULT_GROUPS, always: Iterable[str] = ()
    ) -> None:
        self.patterns = tuple(patterns)
        if not self.patterns:
            raise ValueError("at least one group name or pattern is needed")
        for pattern in self.patterns:
            problem = group_name_problem(pattern)
            if problem is not None:
                raise ValueError(f"group pattern {shown(pattern)}: {problem}")
        self._globs = tuple(p for p in self.patterns if not _GLOB.isdisjoint(p))
        #: names without a wildcard, and the `always` names: each always gets a group slot
        self.exact = frozenset(p for p in self.patterns if _GLOB.isdisjoint(p))
        for name in always:
            if group_name_problem(name) is not None or not self.admits(name):
                raise ValueError(f"group {shown(name)} is not one --groups {self} admits")
        self.exact |= frozenset(always)

    def admits(self, name: str) -> bool:
        """Whether `name` (a valid group name) is one the deployment expects."""
        return name in self.exact or any(fnmatchcase(name, glob) for glob in self._globs)

    def __str__(self) -> str:
        return ",".join(self.patterns)
