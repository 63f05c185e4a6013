"""The docs keep to the code they quote: the state table is `TRANSITIONS`, the README's test
commands are what `.ci/run` runs, and every link between the pages lands. (The README's client
snippet runs against a real coordd: tests/integration/test_misuse.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordd.proto.group_state import TRANSITIONS

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _table() -> set[tuple[str, str, str]]:
    return {
        (state.name, event.name, after.name)
        for state, moves in TRANSITIONS.items()
        for event, after in moves.items()
    }


def test_the_design_pages_state_table_is_transitions() -> None:
    """Issue 20: three copies of the table (README, the docstring, `TRANSITIONS`) that nothing
    tied together. docs/design.md's table must list exactly the moves of `TRANSITIONS` (the
    docstring's: tests/unit/test_state_table.py)."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\s*\| ([A-Z_]+) \| ([A-Z_]+) \| ([A-Z_]+) \|", text, re.MULTILINE)
    assert len(rows) == len(set(rows)), "a move listed twice"
    assert set(rows) == _table()


def _sh_blocks(text: str) -> list[str]:
    return [b.replace("\\\n", " ") for b in re.findall(r"```sh\n(.*?)```", text, re.DOTALL)]


def test_the_readmes_test_commands_are_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = re.sub(r"\\\n\s*", " ", (ROOT / ".ci" / "run").read_text())
    (tests,) = [b for b in _sh_blocks(readme) if "pip install -e '.[test]'" in b]
    main, vllm = [" ".join(line.split()) for line in tests.strip().splitlines()]
    assert main == "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' "\
        "&& pytest"
    for step in main.split(" && "):
        assert step in ci, step
    assert vllm.startswith('VLLM_TARGET_DEVICE=cpu "$(.ci/vllm-env)" -m pytest ')
    paths = vllm.split(" -m pytest ")[1]
    assert f"-m pytest {paths}" in " ".join(ci.split()), paths
    contributing = (ROOT / "docs" / "contributing.md").read_text()
    assert tests in _sh_blocks(contributing)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_between_the_pages_lands(page: Path) -> None:
    text = page.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked.read_text()), f"{page.name}: {target}"


def test_the_readme_is_for_the_operator_and_short() -> None:
    readme = (ROOT / "README.md").read_text()
    first = readme.split("\n\n")[1]
    assert "vLLM" in first and "sidecar" in first
    assert len(readme.splitlines()) <= 260


def test_the_readmes_snippet_waits_longer_than_coordds_step_timeout() -> None:
    """Issue 30: the snippet's `wait(timeout=30)` equalled coordd's default --step-timeout, so
    the client's own "no decision within 30s" (naming nobody) raced coordd's StepTimeout
    naming the late rank. The snippet waits with the default, which outlives it."""
    from coordd.client.config import default_wait_timeout
    from coordd.proto.defaults import HEARTBEAT_TIMEOUT, STEP_TIMEOUT

    readme = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    waits = [w for s in snippets for w in re.findall(r"\.wait\(([^)]*)\)", s)]
    assert waits, "the README's snippet waits for its decision"
    for args in waits:
        given = re.search(r"timeout\s*=\s*([\d.]+)", args)
        assert given is None or float(given.group(1)) > STEP_TIMEOUT + HEARTBEAT_TIMEOUT, args
    assert default_wait_timeout(STEP_TIMEOUT, HEARTBEAT_TIMEOUT) > STEP_TIMEOUT
