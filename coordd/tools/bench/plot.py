"""`--plot FILE.png`: four panels: round latency against dp per method, exposed wait against
work, the engine loop's share of step time blocked in DP sync, and the across-host model.

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
    "device-gloo": ("tab:orange", "v"),
    "coordd-ipc (lean ranks)": ("tab:olive", "P"),
    "coordd-ipc (aio ranks)": ("tab:purple", "X"),
    "gloo sync": ("tab:red", "^"),
    "vLLM cpu_all_reduce_ sync": ("tab:brown", "*"),
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
    ax.set_xlabel("dp (rank processes; simulated ranks for dp >= 16)")
    ax.set_ylabel("round latency, us")
    ax.set_title("Round latency against dp: coordd vs pyzmq hub, floor, gloo, vLLM (measured)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _overlap(ax: Any, results: dict[str, Any]) -> None:
    overlap = results.get("overlap", [])
    if not overlap:
        ax.set_axis_off()
        return
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
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    marker=marker,
                    ls=ls,
                    label=f"{method}, {'sleeping' if variant == 'sleep' else 'spinning'} work",
                )
        sync = next(r["sync_p50_us"] for r in rows if r["method"] == method)
        ax.axhline(sync, color=color, ls=":", alpha=0.5, label=f"{method} sync round p50")
    ax.set_yscale("log")
    ax.set_xlabel("work W between start and wait, us")
    ax.set_ylabel("exposed wait p50, us")
    ax.set_title(f"Overlap at dp={dp}: wait left after W of work, per method (measured)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _engine(ax: Any, results: dict[str, Any]) -> None:
    rows = results.get("engine", [])
    if not rows:
        ax.set_axis_off()
        return
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
    ax.legend(fontsize=7)


def _model(ax: Any, results: dict[str, Any]) -> None:
    rows = results.get("crosshost_model") or crosshost.model(results)
    full = [r for r in rows if all(f"trips_{n}n" in r for n in crosshost.NODES)]
    if not full:
        ax.set_axis_off()
        return
    dp = max(r["dp"] for r in full)
    rows = [r for r in full if r["dp"] == dp]
    cases = [(n, rtt) for n in crosshost.NODES for rtt in crosshost.RTTS_US]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        color, _marker = _STYLE.get(row["method"], ("black", "x"))
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(cases))]
        base = [row["base_p50_us"]] * len(cases)
        ax.bar(
            xs,
            base,
            width,
            color=color,
            label=f"{row['method']}: measured p50 {row['base_p50_us']:.0f} us ({row['base_from']})",
        )
        ax.bar(
            xs,
            [row[f"p50_{n}n_{rtt:g}us"] - row["base_p50_us"] for n, rtt in cases],
            width,
            bottom=base,
            color=color,
            alpha=0.35,
            hatch="//",
            label=f"{row['method']}: modelled network trips "
            f"({', '.join(str(row[f'trips_{n}n']) for n in crosshost.NODES)} at "
            f"{'/'.join(str(n) for n in crosshost.NODES)} nodes) x RTT/2",
        )
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{n} nodes\nRTT {rtt:g} us" for n, rtt in cases])
    ax.set_yscale("log")
    ax.set_ylabel("modelled round p50, us")
    ax.set_title(
        f"Across hosts at dp={dp}, MODELLED: measured local p50 (solid) + network trips x RTT/2 "
        "(hatched)",
        fontsize=9,
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "coordd bench --plot needs matplotlib: pip install 'coordd[plot]'"
        ) from None
    fig, axes = plt.subplots(2, 2, figsize=(17, 11))
    _latency(axes[0][0], results)
    _overlap(axes[0][1], results)
    _engine(axes[1][0], results)
    _model(axes[1][1], results)
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
