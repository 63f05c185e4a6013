"""`--plot FILE.png`: up to four panels, one for each part that ran: round latency against dp
per method, exposed wait against work, the engine loop's share of step time blocked in DP sync,
and the across-host model (on a linear axis, so the modelled network share is as wide as it is).

matplotlib is an optional extra (`pip install 'coordd[plot]'`), imported only here.
"""

from __future__ import annotations

from typing import Any

from coordd.tools.bench import crosshost

_STYLE = {
    "coordd-ipc": ("tab:blue", "o"),
    "coordd-tcp": ("tab:cyan", "s"),
    "zmq-hub": ("tab:green", "h"),
    "floor": ("tab:gray", "D"),
    "gloo": ("tab:red", "^"),
    "vllm-cpu-all-reduce": ("tab:brown", "*"),
    "vllm-plugin": ("tab:pink", "p"),
    "device-gloo": ("tab:orange", "v"),
    "gloo-bare": ("tab:orange", "1"),
    "device-nccl": ("gold", "v"),
    "nccl-bare": ("gold", "1"),
    "coordd-ipc (lean ranks)": ("tab:olive", "P"),
    "coordd-ipc (aio ranks)": ("tab:purple", "X"),
    "gloo sync": ("tab:red", "^"),
    "vLLM cpu_all_reduce_ sync": ("tab:brown", "*"),
    "vLLM plugin sync": ("tab:pink", "p"),
    "coordd sync": ("tab:cyan", "s"),
    "coordd overlap": ("tab:blue", "o"),
}


def _plain_ticks(ax: Any, values: list[int]) -> None:
    """Log-2 axis with plain labels (2, 4, 8, 16 ...), not 2^1, 2^2."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([str(v) for v in values])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _latency(ax: Any, results: dict[str, Any]) -> None:
    series: dict[str, list[tuple[int, float, float]]] = {}
    for row in results.get("latency", []):
        series.setdefault(row["method"], []).append((row["dp"], row["p50_us"], row["p99_us"]))
    for row in results.get("scale", []):
        series.setdefault(f"coordd-ipc ({row.get('client', 'aio')} ranks)", []).append(
            (row["dp"], row["p50_us"], row["p99_us"])
        )
    dps: set[int] = set()
    for name, points in series.items():
        points.sort()
        color, marker = _STYLE.get(name, ("black", "x"))
        xs = [p[0] for p in points]
        dps.update(xs)
        ax.plot(xs, [p[1] for p in points], color=color, marker=marker, label=f"{name} p50")
        ax.plot(
            xs,
            [p[2] for p in points],
            color=color,
            marker=marker,
            ls=":",
            alpha=0.5,
            label=f"{name} p99",
        )
    if dps:
        _plain_ticks(ax, sorted(dps))
    ax.set_yscale("log")
    simulated = bool(results.get("scale"))
    ax.set_xlabel("dp (rank processes" + ("; simulated ranks for dp >= 16)" if simulated else ")"))
    ax.set_ylabel("round latency, us (solid p50, dotted p99)")
    ax.set_title("Round latency against dp (measured)")
    ax.grid(True, which="both", alpha=0.3)
    # one entry per method (its p99 is the dotted line of the same colour)
    handles, labels = ax.get_legend_handles_labels()
    keep = [(h, lb.removesuffix(" p50")) for h, lb in zip(handles, labels, strict=True)]
    keep = [(h, lb) for h, lb in keep if not lb.endswith(" p99")]
    ax.legend([h for h, _ in keep], [lb for _, lb in keep], fontsize=8, ncol=2)


def _overlap(ax: Any, results: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D

    overlap = results.get("overlap", [])
    dp = max(r["dp"] for r in overlap)
    rows = [r for r in overlap if r["dp"] == dp]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    variants = [v for v in ("sleep", "spin") if any(r["variant"] == v for r in rows)]
    styles = {"sleep": "-", "spin": "--"}
    for method in methods:
        color, marker = _STYLE.get(method, ("black", "x"))
        for variant in variants:
            pts = sorted(
                (r["work_us"], r["exposed_p50_us"])
                for r in rows
                if r["method"] == method and r["variant"] == variant
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    marker=marker,
                    ls=styles[variant],
                )
        sync = next(r["sync_p50_us"] for r in rows if r["method"] == method)
        ax.axhline(sync, color=color, ls=":", alpha=0.5)
    # the legend: one entry per method (its colour), one per line style
    handles = [
        Line2D([], [], color=_STYLE.get(m, ("black", "x"))[0], marker=_STYLE.get(m, ("", "x"))[1])
        for m in methods
    ]
    labels = list(methods)
    for variant in variants:
        handles.append(Line2D([], [], color="black", ls=styles[variant]))
        labels.append("sleeping work" if variant == "sleep" else "spinning work")
    handles.append(Line2D([], [], color="black", ls=":", alpha=0.5))
    labels.append("the method's sync round p50")
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel("work W between start and wait, us")
    ax.set_ylabel("exposed wait p50, us")
    ax.set_title(f"Overlap at dp={dp}: wait left after W of work (measured)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles, labels, fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))


def _engine(ax: Any, results: dict[str, Any]) -> None:
    rows = results.get("engine", [])
    dps = sorted({r["dp"] for r in rows})
    for mode in dict.fromkeys(r["mode"] for r in rows):
        color, marker = _STYLE.get(mode, ("black", "x"))
        pts = sorted(
            (r["dp"], 100 * r["blocked_share"], r["mean_step_ms"])
            for r in rows
            if r["mode"] == mode
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color=color,
            marker=marker,
            label=f"{mode} (step ms: {', '.join(f'{p[2]:.1f}' for p in pts)})",
        )
    _plain_ticks(ax, dps)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("dp")
    ax.set_ylabel("share of step time blocked in DP sync, %")
    ax.set_title(
        f"Engine loop (vLLM-shaped steps, GPU time simulated, {rows[0]['step_ms']:g} ms scale): "
        "time blocked in DP sync (measured)",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _model_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = results.get("crosshost_model") or crosshost.model(results)
    return [r for r in rows if all(f"trips_{n}n" in r for n in crosshost.NODES)]


def _model(ax: Any, results: dict[str, Any]) -> None:
    """Each method's modelled round as 100%: the measured local p50's share (solid) and the
    network trips' (hatched), so the model's part is as visible for a 100 us round as for a
    20 ms one; the modelled p50 itself is written above each bar."""
    full = _model_rows(results)
    dp = max(r["dp"] for r in full)
    rows = [r for r in full if r["dp"] == dp]
    cases = [(n, rtt) for n in crosshost.NODES for rtt in crosshost.RTTS_US]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        color, _marker = _STYLE.get(row["method"], ("black", "x"))
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(cases))]
        base = row["base_p50_us"]
        totals = [row[f"p50_{n}n_{rtt:g}us"] for n, rtt in cases]
        local = [100 * base / total for total in totals]
        ax.bar(xs, local, width, color=color, label=row["method"])
        ax.bar(
            xs,
            [100 - share for share in local],
            width,
            bottom=local,
            color="white",
            edgecolor=color,
            hatch="///",
        )
        for x, total in zip(xs, totals, strict=True):
            ax.text(x, 101, f"{total:,.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{n} nodes\nRTT {rtt:g} us" for n, rtt in cases])
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("share of the modelled round p50, %")
    ax.set_title(
        f"Across hosts at dp={dp}, MODELLED: measured local p50 (solid) + network trips x RTT/2"
        " (hatched);\nthe modelled p50 in us above each bar",
        fontsize=9,
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(rows), loc="upper center", bbox_to_anchor=(0.5, -0.12))


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "coordd bench --plot needs matplotlib: pip install 'coordd[plot]'"
        ) from None
    panels = [
        draw
        for draw, ran in (
            (_latency, results.get("latency") or results.get("scale")),
            (_overlap, results.get("overlap")),
            (_engine, results.get("engine")),
            (_model, _model_rows(results)),
        )
        if ran
    ]
    if not panels:
        raise SystemExit("coordd bench --plot: nothing was measured, nothing to draw")
    cols = 1 if len(panels) == 1 else 2
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(8.5 * cols, 5.5 * rows), squeeze=False)
    for i, draw in enumerate(panels):
        draw(axes[i // cols][i % cols], results)
    if len(panels) % cols:
        axes[-1][-1].set_axis_off()
    meta = results.get("meta", {})
    load = [f"{x[0]:.2f}" for x in (meta.get("loadavg_start"), meta.get("loadavg_end")) if x]
    fig.suptitle(
        f"coordd bench: {meta.get('cpus', '?')} CPUs, load average {' -> '.join(load) or '?'} "
        f"(start -> end), {meta.get('started', '')}; a shared machine: figures are noisy",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
