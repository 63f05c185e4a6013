"""docs/bench.md's flat-against-relays section quotes one run: docs/bench-relays.json, rendered
by the current report code into docs/bench-relays.txt; its table block and the figures its
prose gives (the root's CPU per round flat and through relays) are that run's."""

from __future__ import annotations

import json
from pathlib import Path

from coordd.tools.bench import report
from tests.unit.test_docs import _fences

ROOT = Path(__file__).resolve().parents[2]


def _section(page: str) -> str:
    start = page.index("## Flat against relays")
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_the_relay_section_quotes_the_run_beside_it() -> None:
    run = json.loads((ROOT / "docs" / "bench-relays.json").read_text())
    rendered = report.render(run)
    assert (ROOT / "docs" / "bench-relays.txt").read_text().rstrip("\n") == rendered
    section = _section((ROOT / "docs" / "bench.md").read_text())
    blocks = [body for lang, body in _fences(section) if lang == "text"]
    assert blocks, "the section quotes its table"
    for block in blocks:
        assert block.strip("\n") in rendered, block[:80]
    prose = " ".join(section.split())
    rows = {(r["dp"], r["layout"]): r for r in run["scale"]}
    for dp in (256, 1024):
        flat = rows[(dp, "flat")]
        tree = next(r for (d, layout), r in rows.items() if d == dp and layout != "flat")
        said = (
            f"dp={dp}: {flat['coordd_cpu_us_per_round'] / 1000:.1f} ms flat, "
            f"{tree['coordd_cpu_us_per_round'] / 1000:.2f} ms through {tree['relays']} relays"
        )
        assert said in prose, said
