"""The chaos table: per fault kind, seeds, faults injected and detected, time to detect, wrong
decisions and hangs, plus every violation the checker found (there should be none)."""

from __future__ import annotations

import statistics
from typing import Any

import msgspec

from coordd.testing.checker import ScenarioResult
from coordd.tools.chaos.spec import Fault, Settings

COLUMNS = (
    "fault kind",
    "seeds",
    "injected",
    "detected",
    "ttd median",
    "ttd max",
    "wrong",
    "hangs",
    "violations",
)


class KindRow(msgspec.Struct, kw_only=True):
    fault: str
    seeds: int
    skipped: int
    injected: int
    #: None where nothing is to be detected (the fault must be absorbed)
    detected: int | None
    ttd_median_ms: float | None
    ttd_max_ms: float | None
    wrong_decisions: int
    hangs: int
    violations: int
    skip_reason: str = ""


def summarize(results: list[ScenarioResult]) -> list[KindRow]:
    rows: list[KindRow] = []
    order = {f.value: i for i, f in enumerate(Fault)}
    for fault in sorted({r.fault for r in results}, key=lambda f: order.get(f, 99)):
        mine = [r for r in results if r.fault == fault]
        ran = [r for r in mine if not r.skipped]
        ttds = [r.ttd for r in ran if r.ttd is not None]
        judged = [r for r in ran if r.detected is not None]
        rows.append(
            KindRow(
                fault=fault,
                seeds=len(mine),
                skipped=len(mine) - len(ran),
                injected=sum(r.injected for r in ran),
                detected=sum(bool(r.detected) for r in judged) if judged else None,
                ttd_median_ms=statistics.median(ttds) * 1000 if ttds else None,
                ttd_max_ms=max(ttds) * 1000 if ttds else None,
                wrong_decisions=sum(r.wrong_decisions for r in ran),
                hangs=sum(r.hangs for r in ran),
                violations=sum(len(r.violations) for r in ran),
                skip_reason=next((r.skipped for r in mine if r.skipped), ""),
            )
        )
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def table(rows: list[KindRow]) -> str:
    body = []
    for row in rows:
        if row.skipped == row.seeds:
            body.append((row.fault, str(row.seeds), "skipped", "", "", "", "", "", ""))
            continue
        body.append(
            (
                row.fault,
                str(row.seeds - row.skipped),
                str(row.injected),
                "-" if row.detected is None else str(row.detected),
                _ms(row.ttd_median_ms),
                _ms(row.ttd_max_ms),
                str(row.wrong_decisions),
                str(row.hangs),
                str(row.violations),
            )
        )
    total = (
        "total",
        str(sum(r.seeds - r.skipped for r in rows)),
        str(sum(r.injected for r in rows)),
        str(sum(r.detected or 0 for r in rows)),
        "",
        "",
        str(sum(r.wrong_decisions for r in rows)),
        str(sum(r.hangs for r in rows)),
        str(sum(r.violations for r in rows)),
    )
    widths = [max(len(c), *(len(b[i]) for b in [*body, total])) for i, c in enumerate(COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    out = [line(COLUMNS), rule, *(line(b) for b in body), rule, line(total)]
    for row in rows:
        if row.skip_reason:
            out.append(f"skipped {row.fault}: {row.skip_reason}")
    return "\n".join(out)


def notable(results: list[ScenarioResult]) -> str:
    """What passed but is worth knowing (a round split by a coordd crash, a mirrored mismatch)."""
    out = []
    for r in results:
        for note in r.notes:
            if "mid-broadcast" in note or "reported first" in note:
                out.append(f"note: {r.fault} seed {r.seed}: {note}")
    return "\n".join(out)


def failures(results: list[ScenarioResult]) -> str:
    """Each failing scenario with its violations and where its logs are."""
    out = []
    for r in results:
        if r.ok or r.skipped:
            continue
        out.append(f"FAILED {r.fault} seed {r.seed} (dp={r.dp}, {r.transport}): {r.directory}")
        out.extend(f"    {v}" for v in r.violations)
    return "\n".join(out)


def as_json(results: list[ScenarioResult], settings: Settings, seconds: float) -> dict[str, Any]:
    return {
        "settings": msgspec.to_builtins(settings),
        "seconds": round(seconds, 3),
        "kinds": msgspec.to_builtins(summarize(results)),
        "scenarios": msgspec.to_builtins(results),
        "ok": all(r.ok or r.skipped for r in results),
    }
