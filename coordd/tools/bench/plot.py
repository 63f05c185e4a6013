"""`--plot FILE.png`: latency against dp per method (log scale), exposed wait against work.

matplotlib is an optional extra (`pip install 'coordd[plot]'`), imported only here.
"""

from __future__ import annotations

from typing import Any

_STYLE = {
    "coordd-ipc": ("tab:blue", "o"),
    "coordd-tcp": ("tab:cyan", "s"),
    "gloo": ("tab:red", "^"),
    "device-gloo": ("tab:orange", "v"),
    "floor": ("tab:gray", "D"),
    "coordd-ipc (lean ranks)": ("tab:green", "P"),
    "coordd-ipc (aio ranks)": ("tab:purple", "X"),
}


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "coordd bench --plot needs matplotlib: pip install 'coordd[plot]'"
        ) from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.6))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for row in results.get("latency", []):
        series.setdefault(row["method"], []).append((row["dp"], row["p50_us"], row["p99_us"]))
    for row in results.get("scale", []):
        series.setdefault(f"coordd-ipc ({row.get('client', 'aio')} ranks)", []).append(
            (row["dp"], row["p50_us"], row["p99_us"])
        )
    for name, points in series.items():
        points.sort()
        color, marker = _STYLE.get(name, ("black", "x"))
        dps = [p[0] for p in points]
        left.plot(dps, [p[1] for p in points], color=color, marker=marker, label=f"{name} p50")
        left.plot(dps, [p[2] for p in points], color=color, marker=marker, ls=":", alpha=0.6)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("dp (rank processes; simulated ranks, 4 processes, for dp >= 16)")
    left.set_ylabel("round latency, us (solid p50, dotted p99)")
    left.set_title("Round latency against dp")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    overlap = results.get("overlap", [])
    if overlap:
        dp = max(r["dp"] for r in overlap)
        rows = [r for r in overlap if r["dp"] == dp]
        for method in dict.fromkeys(r["method"] for r in rows):
            color, marker = _STYLE.get(method, ("black", "x"))
            for variant, ls in (("sleep", "-"), ("spin", "--")):
                pts = sorted(
                    (r["work_us"], r["exposed_p50_us"])
                    for r in rows
                    if r["method"] == method and r["variant"] == variant
                )
                if pts:
                    right.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        color=color,
                        marker=marker,
                        ls=ls,
                        label=f"{method} ({variant})",
                    )
            sync = next(r["sync_p50_us"] for r in rows if r["method"] == method)
            right.axhline(sync, color=color, ls=":", alpha=0.5)
        right.set_yscale("log")
        right.set_xlabel("work W between start and wait, us")
        right.set_ylabel("exposed wait p50, us (dotted: sync round p50)")
        right.set_title(f"Overlap at dp={dp}: solid sleeping work, dashed spinning")
        right.grid(True, which="both", alpha=0.3)
        right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        right.set_axis_off()
    meta = results.get("meta", {})
    fig.suptitle(
        f"coordd bench: {meta.get('cpus', '?')} CPUs, {meta.get('started', '')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
