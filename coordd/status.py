"""coordd's status: the /status document (built in the daemon) and `coordd status` (a table).

The document says where the group stands (its state, epoch, the open round, readiness, the
failure if any) and, per rank, who holds it (routing id, address, incarnation), when it last
reported, how many rounds it took part in, how late its reports come on average, and how often
it was the last to report (the straggler). `coordd status` fetches it over HTTP and prints it as a
table; `coordd status --probe livez|readyz` is the health check the deploy files run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from coordd.proto.messages import PROTOCOL_VERSION
from coordd.proto.snapshot import GroupSnapshot, OnRankLoss

if TYPE_CHECKING:
    from coordd.metrics import Observer
    from coordd.server import CoordServer

#: The port the deploy files serve metrics and health on, and `coordd status` asks by default.
DEFAULT_METRICS_PORT = 9180


def readiness(snap: GroupSnapshot) -> tuple[bool, str]:
    """Ready: every dp rank registered (neutralize mode: or left out) and the group not failed."""
    failure = snap.failure
    if failure is not None:
        return False, f"group failed at seq {failure.seq}: {failure.text}"
    present = len(snap.members)
    counted = present + (len(snap.dead) if snap.on_rank_loss is OnRankLoss.NEUTRALIZE else 0)
    if present == 0 or counted < snap.dp_size:
        return False, f"{present}/{snap.dp_size} ranks registered"
    if snap.dead:
        return True, f"{present}/{snap.dp_size} ranks registered, left out: {sorted(snap.dead)}"
    return True, f"{present}/{snap.dp_size} ranks registered"


def status_document(server: CoordServer, observer: Observer) -> dict[str, Any]:
    """The /status JSON: O(dp x recent rounds) work, only when asked."""
    from coordd.metrics import version

    snap = server.coordinator.snapshot()
    now = server.clock()
    ready, why = readiness(snap)
    lateness = observer.mean_lateness()
    last = snap.last_round
    open_round = snap.round
    ranks = []
    for rank in range(snap.dp_size):
        member = snap.members.get(rank)
        state = "registered" if member else ("left out" if rank in snap.dead else "missing")
        arrived = open_round.arrivals[rank] if open_round is not None else None
        seen = arrived
        if seen is None and last is not None:
            seen = last.arrivals[rank]
        if seen is None and member is not None:
            seen = member.joined_at
        entry: dict[str, Any] = {
            "rank": rank,
            "state": state,
            "peer": member.peer.decode("utf-8", "backslashreplace") if member else None,
            "address": observer.addresses.get(member.peer) if member else None,
            "incarnation": member.hello.incarnation if member else None,
            "last_seen_s": None if seen is None else round(max(0.0, now - seen), 6),
            "reported_open_round": arrived is not None,
            "rounds": observer.rounds_of(rank) if member else 0,
            "mean_lateness_s": lateness[rank],
            "straggler_rounds": observer.stragglers[rank],
        }
        ranks.append(entry)
    failure = snap.failure
    return {
        "coordd": {
            "version": version(),
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "address": server.bound_address,
            "uptime_s": round(observer.wall() - observer.started_wall, 3),
        },
        "group": observer.group,
        "dp_size": snap.dp_size,
        "state": snap.state.value,
        "epoch": snap.epoch,
        "seq": snap.seq,
        "on_rank_loss": snap.on_rank_loss.value,
        "step_timeout_s": snap.step_timeout,
        "ready": ready,
        "ready_detail": why,
        "round": {
            "open": open_round is not None,
            "kind": open_round.kind.value if open_round is not None else None,
            "reported": open_round.reported if open_round is not None else 0,
            "age_s": None if open_round is None else round(now - open_round.started, 6),
        },
        "failure": None
        if failure is None
        else {
            "epoch": failure.epoch,
            "seq": failure.seq,
            "kind": failure.kind.value,
            "reason": failure.reason.value,
            "ranks": list(failure.culprits),
            "text": failure.text,
        },
        "rounds": {
            "completed": observer.rounds_completed,
            "decided": dict(observer.decided),
            "failed": dict(observer.failed),
        },
        "lateness_window_rounds": len(observer.recent),
        "faults": dict(observer.faults),
        "frames": {
            "received": server.stats.frames_in,
            "sent": server.stats.frames_out,
            "bad": server.stats.bad_frames,
        },
        "disconnects": server.stats.disconnects,
        "ranks": ranks,
        "recent_failures": list(observer.recent_failures),
    }


# -- `coordd status`: the table ---------------------------------------------------------------


def default_url() -> str:
    """$COORDD_STATUS_URL, else http://127.0.0.1:<$COORDD_METRICS_PORT or 9180>."""
    url = os.environ.get("COORDD_STATUS_URL")
    if url:
        return url
    port = os.environ.get("COORDD_METRICS_PORT") or str(DEFAULT_METRICS_PORT)
    return f"http://127.0.0.1:{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=default_url(),
        help="coordd's metrics/health base URL (default: $COORDD_STATUS_URL, else "
        f"http://127.0.0.1:$COORDD_METRICS_PORT, port {DEFAULT_METRICS_PORT} if unset)",
    )
    p.add_argument("--json", action="store_true", help="print the raw /status JSON")
    p.add_argument(
        "--probe",
        choices=["livez", "readyz"],
        help="health check: exit 0 if the endpoint answers 200, else 1",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for coordd")


def _base(url: str) -> str:
    url = url.rstrip("/")
    for suffix in ("/status", "/metrics", "/livez", "/readyz"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def fetch(url: str, timeout: float) -> tuple[int, bytes]:
    """GET `url`: (HTTP status, body); raises OSError if coordd cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def run(args: argparse.Namespace) -> int:
    base = _base(args.url)
    if not base.startswith(("http://", "https://")):
        print(f"coordd status: --url must be http://HOST:PORT, got {args.url!r}", file=sys.stderr)
        return 2
    path = f"/{args.probe}" if args.probe else "/status"
    try:
        code, body = fetch(base + path, args.timeout)
    except OSError as exc:
        print(f"coordd status: cannot reach coordd at {base + path}: {exc}", file=sys.stderr)
        return 2 if not args.probe else 1
    if args.probe:
        print(f"{args.probe}: {code} {body.decode('utf-8', 'replace').strip()}")
        return 0 if code == 200 else 1
    if code != 200:
        print(f"coordd status: {base + path} answered {code}", file=sys.stderr)
        return 2
    document = json.loads(body)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render(document))
    return 0


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return lines


def render(doc: dict[str, Any]) -> str:
    """The status document as a terminal table."""
    info = doc["coordd"]
    rounds = doc["rounds"]
    rnd = doc["round"]
    lines = [
        f"coordd {info['version']} (protocol {info['protocol_version']}) at {info['address']}"
        f", pid {info['pid']}, up {_seconds(info['uptime_s'])}",
        f"group {doc['group']}  dp {doc['dp_size']}  state {doc.get('state', '-')}"
        f"  epoch {doc['epoch']}  seq {doc['seq']}"
        f"  on rank loss: {doc['on_rank_loss']}  step timeout {_seconds(doc['step_timeout_s'])}",
        f"ready: {'yes' if doc['ready'] else 'NO'} ({doc['ready_detail']})",
    ]
    if rnd["open"]:
        lines.append(
            f"round {doc['seq']}: open, {rnd['kind']}, {rnd['reported']}/{doc['dp_size']} "
            f"reported, {_seconds(rnd['age_s'])} old"
        )
    decided = ", ".join(f"{k} {n}" for k, n in sorted(rounds["decided"].items())) or "none"
    failed = sum(rounds["failed"].values())
    frames = doc["frames"]
    lines.append(
        f"rounds decided: {decided}; failed: {failed}; frames in {frames['received']}, "
        f"out {frames['sent']}, bad {frames['bad']}; disconnects {doc['disconnects']}"
    )
    if doc["failure"]:
        f = doc["failure"]
        lines.append(
            f"FAILED: epoch {f['epoch']} seq {f['seq']} {f['kind']} {f['reason']} "
            f"ranks {f['ranks']}: {f['text']}"
        )
    lines.append("")
    rows = [
        [
            str(r["rank"]),
            r["state"],
            r["address"] or r["peer"] or "-",
            r["incarnation"] or "-",
            _seconds(r["last_seen_s"]) + (" ago" if r["last_seen_s"] is not None else ""),
            str(r["rounds"]),
            _seconds(r["mean_lateness_s"]),
            str(r["straggler_rounds"]),
        ]
        for r in doc["ranks"]
    ]
    lines += _table(
        ["RANK", "STATE", "PEER", "INCARNATION", "LAST SEEN", "ROUNDS", "MEAN LATENESS", "LAST IN"],
        rows,
    )
    lines.append(
        f"(mean lateness: after the round's first report, over the last "
        f"{doc['lateness_window_rounds']} rounds; last in: rounds this rank completed)"
    )
    if doc["recent_failures"]:
        lines += ["", "recent failures:"]
        for f in doc["recent_failures"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["time"]))
            lines.append(
                f"  {when} epoch {f['epoch']} seq {f['seq']} {f['kind']} {f['reason']} "
                f"ranks {f['ranks']}: {f['text']}"
            )
    return "\n".join(lines)
