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


def _fences(text: str) -> list[tuple[str, str]]:
    """Every fenced block of a page: (its language, its text)."""
    out, lang, body = [], None, []  # type: ignore[var-annotated]
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if lang is None:
                lang, body = line.strip()[3:], []
            else:
                out.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


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
    from coordd.client._config import default_wait_timeout
    from coordd.proto.defaults import HEARTBEAT_TIMEOUT, STEP_TIMEOUT

    readme = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    waits = [w for s in snippets for w in re.findall(r"\.wait\(([^)]*)\)", s)]
    assert waits, "the README's snippet waits for its decision"
    for args in waits:
        given = re.search(r"timeout\s*=\s*([\d.]+)", args)
        assert given is None or float(given.group(1)) > STEP_TIMEOUT + HEARTBEAT_TIMEOUT, args
    assert default_wait_timeout(STEP_TIMEOUT, HEARTBEAT_TIMEOUT) > STEP_TIMEOUT


# -- issue 30, item 7: the facts the docs state, held to the code ---------------------------------


def _leave_and_stop_outputs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What coordd says when one of two ranks leaves cleanly and the other syncs on, and when
    both leave: its log lines, /readyz's texts and the error the other rank gets."""
    import logging

    from coordd.ops.status_doc import server_readiness
    from coordd.proto.messages import Goodbye, StepFailed, error_from_failure
    from tests.unit.test_observability import peer, registered

    said: list[str] = []
    with caplog.at_level(logging.INFO, logger="coordd"):
        for both_leave in (False, True):
            d = registered(2)
            d.report(0, 0, 101.0)
            d.report(1, 0, 101.5)
            g = d.group()
            leaving = (0, 1) if both_leave else (1,)
            for rank in leaving:
                d._after(g.coordinator.receive(peer(rank), Goodbye(text="rank closed"), 102.0), g)
            snap = g.coordinator.snapshot()
            if snap.stops != g.observer.stops_seen:  # as the server does after a drain
                g.observer.group_stopped(snap)
            said.append(server_readiness(d)[1])  # type: ignore[arg-type]
            if not both_leave:
                d.report(0, 1, 103.0)
                failures = [m for m in d.sent if type(m) is StepFailed]
                said.append(repr(error_from_failure(failures[-1])))
                said.append(server_readiness(d)[1])  # type: ignore[arg-type]
    said += [r.getMessage() for r in caplog.records]
    return said


#: The quotes of docs/operations.md's departures bullet that are coordd's own words.
SAID_QUOTES = ("0/1 groups formed", "RankLost(", "group failed", "group default failed",
               "group stopped", "1/1 groups stopped")


def test_operations_md_quotes_what_coordd_says_when_ranks_leave(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 30: the page said a rank leaving cleanly gave "group stopped: a rank left" and a
    503 "... left the group (closed cleanly)"; observed, with one of two ranks closing: a
    warning "group failed ... reason=lost ... left the group". Every quote of coordd's words
    in the bullet must match what the code says in that scenario ("..." for any text, seq 41
    for any seq)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    bullet = text[text.index("- **A rank that leaves cleanly**"):]
    bullet = bullet[:bullet.index("\n- **", 5)] if "\n- **" in bullet[5:] else bullet
    quotes = [" ".join(q.split()) for q in re.findall(r"`([^`]+)`", bullet, re.DOTALL)]
    quoted = [q for q in quotes if q.startswith(SAID_QUOTES)]
    assert {p for p in SAID_QUOTES if any(q.startswith(p) for q in quoted)} == set(SAID_QUOTES)
    said = _leave_and_stop_outputs(caplog)
    for quote in quoted:
        pattern = ".*".join(re.escape(part).replace("41", r"\d+") for part in quote.split("..."))
        pattern = pattern.replace(re.escape("RankLost(ranks=[1], detail=\"left the group\")"),
                                  r"RankLost\(.*")
        assert any(re.search(pattern, s) for s in said), (quote, said)
    error = next(s for s in said if s.startswith("RankLost("))
    assert "ranks=(1,)" in error or "[1]" in error, error
    assert "left the group" in error


def test_the_error_tables_list_every_error() -> None:
    """Issue 30: docs/design.md's error table lacked `InvalidAnswer`. Every `CoordError` class
    the package exports has a row in design.md's table and in the README's."""
    from coordd import proto
    from coordd.proto.errors import CoordError

    errors = {name for name in dir(proto)
              if isinstance(getattr(proto, name), type)
              and issubclass(getattr(proto, name), CoordError) and name != "CoordError"}
    assert "InvalidAnswer" in errors
    for page in (ROOT / "docs" / "design.md", ROOT / "README.md"):
        rows = [line for line in page.read_text().splitlines() if line.startswith("| `")]
        named = {n for line in rows for n in re.findall(r"`(\w+)`", line.split(" | ")[0])}
        assert errors <= named, f"{page.name}: no row for {sorted(errors - named)}"


def test_no_page_installs_coordd_from_pypi() -> None:
    """Issue 30: the README said "Not on PyPI" beside `pip install --no-deps coordd`."""
    for page in PAGES:
        for command in re.findall(r"pip install[^`\n]*", page.read_text()):
            words = command.split("&&")[0].split("#")[0].split()
            assert "coordd" not in words and not any(w.startswith(("coordd[", "'coordd["))
                                                     for w in words), (page.name, command)


def test_the_readme_names_every_stage_ci_runs() -> None:
    """Issue 30: the README's test section left out the vLLM 0.32 and engine stages `.ci/run`
    runs, and said nothing of how long the suite takes."""
    ci = (ROOT / ".ci" / "run").read_text()
    stages = [a or b for a, b in re.findall(r'^stage (?:"([^"]+)"|(\S+)) ', ci, re.MULTILINE)]
    assert len(stages) >= 8, stages
    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme[readme.index("Run the tests"):readme.index("## Using coordd")]
                       .split())
    for name in stages:
        assert name in section, name
    assert "minutes" in section


def test_bench_md_quotes_one_run_the_one_beside_it() -> None:
    """Issue 30: docs/bench.md's prose and tables came from an older run than bench.txt and
    bench.json beside it (dp=8 coordd/hub 1.20x there, 1.39x in bench.json). bench.txt is
    bench.json rendered by the current report code; every table bench.md quotes is in it; its
    prose figures are bench.json's."""
    import json

    from coordd.tools.bench import report

    run = json.loads((ROOT / "docs" / "bench.json").read_text())
    rendered = report.render(run)
    assert (ROOT / "docs" / "bench.txt").read_text().rstrip("\n") == rendered
    page = (ROOT / "docs" / "bench.md").read_text()
    blocks = [body for lang, body in _fences(page) if not lang]
    assert len(blocks) >= 2
    for block in blocks:
        assert block.strip("\n") in rendered, block[:80]
    prose = " ".join(page.split())
    meta = run["meta"]
    assert (f"From that run ({meta['started']}, {meta['cpus']} CPUs shared with other work, "
            f"load average {meta['loadavg_start'][0]:.2f} at the start and "
            f"{meta['loadavg_end'][0]:.2f} at the end") in prose

    def row(method: str) -> dict:
        return next(r for r in run["latency"] if r["dp"] == 8 and r["method"] == method)

    ours, hub = row("coordd-ipc"), row("zmq-hub")
    assert f"coordd costs {ours['cpu_us_per_round']:.0f} against the hub's " \
           f"{hub['cpu_us_per_round']:.0f}" in prose
    mine, theirs = ours["cpu_us_per_round_by_thread"], hub["cpu_us_per_round_by_thread"]
    assert f"ranks {mine['ranks main']:.0f} vs {theirs['ranks main']:.0f} and coordd " \
           f"{mine['server main']:.0f} vs {theirs['server main']:.0f}" in prose


# -- issue 39, item 5: figures that go stale, and commands said to be the same ---------------------


def test_no_page_states_a_count_of_tests() -> None:
    """The README's "1622 tests" was 1668 a day later: a count changes with every commit, so no
    page states one; the suite's time keeps the date of its run."""
    for page in [*PAGES, ROOT / "deploy" / "README.md"]:
        assert not re.search(r"\b\d+ (?:tests|passed)\b", page.read_text()), page.name
    readme = " ".join((ROOT / "README.md").read_text().split())
    dated = r"main suite \(about \d+ minutes on 2 cores: \d+ s in a fresh clone on \d{4}-\d\d-\d\d,"
    assert re.search(dated, readme), "the suite's time keeps the date of its run"


def test_what_the_docs_say_coordd_bench_vllm_engine_runs_is_what_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/vllm.md called `coordd bench --vllm-engine 6` the same as the command of its table
    (`--device cpu ... --max-tokens 64`); it runs 48 tokens and no --device."""
    import argparse

    from coordd.tools import bench, vllm_e2e

    ran: list[list[str]] = []
    monkeypatch.setattr(vllm_e2e, "main", lambda argv: ran.append(list(argv)) or 0)
    said = []
    for page in PAGES:
        prose = " ".join(page.read_text().split())
        assert "(or `coordd bench --vllm-engine" not in prose, page.name
        said += re.findall(
            r"`coordd bench --vllm-engine (\d+)` runs `python -m coordd.tools.vllm_e2e ([^`]*)`",
            prose,
        )
    assert said
    for sets, command in said:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        assert bench.run(parser.parse_args(["--vllm-engine", sets])) == 0
        assert ran.pop() == command.split()
