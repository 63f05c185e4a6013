"""The V1 runner's DP sync per step, side by side: stock vLLM, the plugin with overlap off, on.

Reads the JSON lines that `coordd.vllm.timings` writes (COORDD_VLLM_TIMINGS=DIR in the rank
processes' environment: one file per process, one line per step) and prints, per mode, p10,
p50 and p90 of:

  sync    the step's thread blocked in `_determine_batch_execution_and_padding` at the sync
          (where vLLM's DP sync waits): what the sync costs the step
  window  from the early start (before `_prepare_inputs`) to the sync (overlap on only)
  wait    of `sync`, the plugin blocked for the round's answer
  round   the round as the rank saw it: start to answer, window + wait (overlap on: an upper
          bound when the answer was there before the sync; off: the wait itself)
  start   the early start's own CPU time (overlap on only)
  cost    sync + start: all the step's thread spent on the sync
  step    `execute_model`

and the ratios (on/off, on/stock, off/stock) of cost, sync and step at p10, p50 and p90.
Only steps that made the sync count (a rank with nothing scheduled returns before it).

    python -m coordd.tools.vllm_steps DIR [DIR ...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

#: The modes in the order the table shows them, and their names there.
MODES = {"stock": "vLLM (gloo)", "off": "coordd, overlap off", "on": "coordd, overlap on"}
FIELDS = ("sync", "window", "wait", "round", "start", "cost", "step")
#: Fields computed from the others, not read.
_DERIVED = ("round", "cost")


def read_steps(directories: Iterable[Path]) -> dict[str, list[dict[str, float]]]:
    """Every step that made the sync, by mode, from the timing files under `directories`."""
    steps: dict[str, list[dict[str, float]]] = {}
    for directory in directories:
        for path in sorted(Path(directory).glob("steps-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed process
                if not isinstance(record, dict) or not record.get("sync"):
                    continue
                mode = str(record.get("mode", "?"))
                step = {k: float(record.get(k, 0.0)) for k in FIELDS if k not in _DERIVED}
                step["round"] = step["window"] + step["wait"] if mode != "stock" else 0.0
                step["cost"] = step["sync"] + step["start"]
                steps.setdefault(mode, []).append(step)
    return steps


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by the nearest rank below (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(steps: Mapping[str, list[dict[str, float]]]) -> dict[str, dict[str, list[float]]]:
    """mode -> field -> [p10, p50, p90] in seconds."""
    return {
        mode: {f: [quantile([s[f] for s in rows], q) for q in (0.1, 0.5, 0.9)] for f in FIELDS}
        for mode, rows in steps.items()
    }


def table(steps: Mapping[str, list[dict[str, float]]]) -> str:
    """The side-by-side table: one row per mode and field (ms, p10/p50/p90), then the p50
    ratios."""
    stats = summary(steps)
    lines = [f"{'':22} {'field':7} {'steps':>6} {'p10 ms':>8} {'p50 ms':>8} {'p90 ms':>8}"]
    for mode, name in MODES.items():
        if mode not in stats:
            continue
        for f in FIELDS:
            if mode == "stock" and f in ("window", "wait", "round", "start"):
                continue
            if mode == "off" and f in ("window", "start"):
                continue
            p10, p50, p90 = (v * 1e3 for v in stats[mode][f])
            lines.append(
                f"{name:22} {f:7} {len(steps[mode]):>6} {p10:>8.3f} {p50:>8.3f} {p90:>8.3f}"
            )
    for mode, base in (("on", "off"), ("on", "stock"), ("off", "stock")):
        if mode in stats and base in stats:
            parts = []
            for f in ("cost", "sync", "step"):
                ratios = [
                    f"{m / b:.2f}" if b else "-"
                    for m, b in zip(stats[mode][f], stats[base][f], strict=True)
                ]
                parts.append(f"{f} {'/'.join(ratios)}")
            lines.append(f"{MODES[mode]} / {MODES[base]} (p10/p50/p90): " + "; ".join(parts))
    return "\n".join(lines)


def per_set(sets: Sequence[Mapping[str, Path]]) -> str:
    """One line per interleaved set (mode -> its timing directory): each mode's p50 sync,
    cost and step, then the on/off and on/stock ratios of the sets' p50s at their p10, p50
    and p90 across sets (paired within a set, so a set the box slowed as a whole cancels)."""
    lines = []
    ratios: dict[str, list[float]] = {}
    for k, dirs in enumerate(sets, 1):
        p50 = {
            mode: {f: v[1] for f, v in stats.items()}
            for mode, stats in summary(read_steps(dirs.values())).items()
        }
        parts = [
            f"{mode} sync {p50[mode]['sync'] * 1e3:.2f} cost {p50[mode]['cost'] * 1e3:.2f} "
            f"step {p50[mode]['step'] * 1e3:.2f}"
            for mode in MODES
            if mode in p50
        ]
        lines.append(f"set {k} (p50 ms): " + "; ".join(parts))
        for mode, base in (("on", "off"), ("on", "stock")):
            for f in ("cost", "step"):
                if mode in p50 and base in p50 and p50[base][f]:
                    key = f"{mode}/{base} {f}"
                    ratios.setdefault(key, []).append(p50[mode][f] / p50[base][f])
    for key, values in ratios.items():
        qs = "/".join(f"{quantile(values, q):.2f}" for q in (0.1, 0.5, 0.9))
        lines.append(f"per-set p50 ratio {key} across {len(values)} sets (p10/p50/p90): {qs}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    steps = read_steps(Path(a) for a in args)
    if not steps:
        print("no timed steps under " + " ".join(args), file=sys.stderr)
        return 1
    print(table(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
