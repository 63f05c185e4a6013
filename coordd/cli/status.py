"""`coordd status`: a running coordd's /status document as a table, and `--probe
livez|readyz`, the health check the deploy files run.

Where it asks (`target`): `--address` (coordd's ipc address, whose status socket `PATH.http`
coordd serves beside it, or an http:// URL of its --metrics-port); else $COORDD_STATUS_URL;
else http://127.0.0.1:$COORDD_METRICS_PORT if that is set (the deploy files); else the status
socket of the user's default address ($COORDD_ADDRESS, or the default ipc path), which every
coordd bound there serves with or without --metrics-port. Nothing else: when that socket is
missing or refuses, it says where it looked and exits 2, rather than ask 127.0.0.1:9180,
which on a shared host another user's process may answer for a coordd that is dead."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from coordd.core._logs import one_line
from coordd.ops.endpoints import status_socket
from coordd.proto.address import resolve_address

#: A base that is a UNIX socket (coordd's status socket) rather than an http:// URL.
UNIX = "unix:"


def default_url() -> str | None:
    """$COORDD_STATUS_URL, else http://127.0.0.1:$COORDD_METRICS_PORT, else None (then the
    default address's status socket: `targets`)."""
    url = os.environ.get("COORDD_STATUS_URL")
    if url:
        return url
    port = os.environ.get("COORDD_METRICS_PORT")
    if not port:
        return None
    if not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise SystemExit(
            f"coordd status: COORDD_METRICS_PORT={port!r}: it takes a port number (0..65535), "
            "the one coordd serves HTTP on (or give --address)"
        )
    return f"http://127.0.0.1:{port}"


def targets(given: str | None) -> list[str]:
    """The bases to ask, in order (see the module's docstring): `unix:PATH` or a URL."""
    if given is not None:
        if given.startswith(("ipc://", "tcp://")):
            path = status_socket(given)
            if path is None:
                raise SystemExit(
                    f"coordd status: --address {given}: coordd serves its status socket only "
                    "beside an ipc path; for a tcp coordd give the URL of its --metrics-port "
                    "(--address http://HOST:PORT)"
                )
            return [UNIX + path]
        return [given]
    url = default_url()
    if url is not None:
        return [url]
    address, _ = resolve_address(None)
    path = status_socket(address)
    return [UNIX + path] if path is not None else []


#: `coordd status`'s exit codes, as its --help and docs/operations.md say them.
EXIT_CODES = (
    "exit codes: 0 the table printed (--probe: the endpoint answered 200); 1 --probe got "
    "another answer or none, or a bad option; 2 no coordd answered, or what answered is not "
    "coordd's /status"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    default_url()  # a bad $COORDD_METRICS_PORT is refused as the command is parsed
    p.epilog = EXIT_CODES
    p.add_argument(
        "--address",
        "--url",
        dest="url",
        default=None,
        help="the coordd to ask: its ipc address (ipc://PATH: coordd serves its status on "
        "PATH.http beside it) or the base URL of its --metrics-port (http://HOST:PORT) "
        "(default: $COORDD_STATUS_URL, else http://127.0.0.1:$COORDD_METRICS_PORT if set, "
        "else the status socket of $COORDD_ADDRESS or the default ipc address, where "
        "`coordd serve` binds; nothing else is tried)",
    )
    p.add_argument("--json", action="store_true", help="print the raw /status JSON")
    p.add_argument(
        "--group",
        help="only this group, with a row for every rank (without it, at most "
        "256 rank rows over all groups)",
    )
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


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a UNIX socket (coordd's status socket)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def get(base: str, target: str, timeout: float) -> tuple[int, bytes]:
    """GET `target` (/status, /readyz, ...) of `base`: a URL, or unix:PATH (a status socket)."""
    if not base.startswith(UNIX):
        return fetch(base + target, timeout)
    connection = _UnixConnection(base[len(UNIX) :], timeout)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        return int(response.status), response.read()
    finally:
        connection.close()


def run(args: argparse.Namespace) -> int:
    """Print the status table, or `--probe`'s line; the exit code as `EXIT_CODES` says."""
    bases = [_base(b) for b in targets(args.url)]
    for base in bases:
        if not base.startswith(("http://", "https://", UNIX)):
            print(
                "coordd status: --address must be ipc://PATH (coordd's) or http://HOST:PORT "
                f"(its --metrics-port), got {args.url!r}",
                file=sys.stderr,
            )
            return 1
    path = f"/{args.probe}" if args.probe else "/status"
    if not args.probe and args.group:
        path += "?" + urllib.parse.urlencode({"group": args.group})
    tried: list[str] = []
    if not bases:  # a tcp (or abstract) default address: no status socket to ask
        address, _ = resolve_address(None)
        tried.append(f"{address}: a coordd serves a status socket only beside an ipc path")
    answer: tuple[str, int, bytes] | None = None
    for base in bases:  # the first that answers
        try:
            code, body = get(base, path, args.timeout)
        except OSError as exc:
            tried.append(unreachable(_shown(base) + ("" if base.startswith(UNIX) else path), exc))
            continue
        except (ValueError, http.client.InvalidURL) as exc:  # a port that is not a number
            print(f"coordd status: --address {args.url!r}: {exc}", file=sys.stderr)
            return 1
        answer = (base, code, body)
        break
    if answer is None:
        print(nobody_answered(tried, args.url is not None), file=sys.stderr)
        return 2 if not args.probe else 1
    base, code, body = answer
    base = _shown(base)
    if args.probe:
        return _print(probe_line(args.probe, code, body), code)
    if code != 200:
        print(f"coordd status: {base + path} answered {code}", file=sys.stderr)
        return 2
    try:
        document = json.loads(body)
    except ValueError:
        print(f"coordd status: {base + path} did not answer JSON: is it coordd?", file=sys.stderr)
        return 2
    return _print(json.dumps(document, indent=2) if args.json else render(document), 200)


def nobody_answered(tried: list[str], given: bool) -> str:
    """What `coordd status` prints when nothing it asked answered: a line per place asked, and
    what to do; one line for an --address given."""
    if given:
        return f"coordd status: no coordd at {tried[0]}"
    return "\n".join(
        [
            "coordd status: no coordd answered",
            *(f"  {one}" for one in tried),
            "start `coordd serve`, or give --address ipc://PATH or http://HOST:PORT (no port "
            "is guessed)",
        ]
    )


def probe_line(probe: str, code: int, body: bytes) -> str:
    """What `--probe` prints: the endpoint, its status and its body on one line, escaped (the
    body may quote a peer's strings: a failed group's error text)."""
    return f"{probe}: {code} {one_line(body.decode('utf-8', 'replace').strip())}"


def escaped(value: Any) -> Any:
    """`value` (the /status document or a part) with every string made safe for a terminal:
    a control character (ESC, BEL, CR, a newline) in a peer's incarnation, a group name or a
    gather site is written as an escape, as the logs do (`coordd.core._logs.one_line`), so it
    cannot retitle the terminal, clear it, or forge a line such as "ready: yes"."""
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, list):
        return [escaped(v) for v in value]
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    return value


def _shown(base: str) -> str:
    """A base as the user would give it: the status socket as its coordd's ipc address."""
    if base.startswith(UNIX):
        return "ipc://" + base[len(UNIX) :].removesuffix(".http")
    return base


def unreachable(url: str, exc: OSError) -> str:
    """`url` and why it did not answer, in a few words: for an ipc address, whether a coordd ever
    bound there (coordd makes the socket's directory and leaves it; it removes its sockets
    when it stops); for a URL, that coordd serves HTTP only with --metrics-port."""
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if isinstance(exc, FileNotFoundError):
            directory = os.path.dirname(path) or "."
            if not os.path.isdir(directory):
                return f"{url}: none was started there (no directory {directory})"
            return f"{url}: none runs there now (its directory exists: one may have stopped)"
        if isinstance(exc, ConnectionRefusedError):
            return f"{url}: its status socket is left from a coordd that is gone"
        return f"{url}: {exc.strerror or exc}"
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError):
        return f"{url}: connection refused (coordd serves HTTP only with --metrics-port)"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"{url}: no answer in time (is the host right, and coordd not stuck?)"
    return f"{url}: {reason}"


def _print(text: str, code: int) -> int:
    """Print to stdout; a reader that went away (`coordd status | head`) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0 if code == 200 else 1


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


#: The per-rank table's columns, and what the footnote says of those that need it.
RANK_COLUMNS: dict[str, str] = {
    "RANK": "",
    "STATE": "",
    "PEER": "",
    "INCARNATION": "",
    "LAST SEEN": "",
    "ROUNDS": "rounds decided while this rank was registered (its latest registration)",
    "MEAN LATENESS": "how long after the round's first report this rank's came, on average "
    "over the last {window} rounds",
    "LAST IN": "rounds whose last report was this rank's (the straggler)",
}


def rank_footnote(window: int) -> str:
    """The footnote under a group's rank table: each column it explains, by its header."""
    parts = [f"{name}: {text.format(window=window)}" for name, text in RANK_COLUMNS.items() if text]
    return "(" + "; ".join(parts) + ")"


def expecting(info: dict[str, Any]) -> str:
    """The groups /readyz waits for: their names, or their count."""
    names = info.get("expected_groups") or []
    return " ".join(str(n) for n in names) if names else str(info["expect_groups"])


def render(doc: dict[str, Any]) -> str:
    """The status document as a terminal table: coordd, then one block per group (every
    string escaped: `escaped`)."""
    doc = escaped(doc)
    info = doc["coordd"]
    frames = doc["frames"]
    lines = [
        f"coordd {info['version']} (protocol {info['protocol_version']}) at {info['address']}"
        f", pid {info['pid']}, up {_seconds(info['uptime_s'])}",
        f"dp {info['dp_size']}  groups {len(doc['groups'])} (at most {info['max_groups']}"
        + (f", expecting {expecting(info)}" if info["expect_groups"] else "")
        + ("; root: takes relays" if info.get("relay_root") else "")
        + f")  frames in {frames['received']}, out {frames['sent']}, bad {frames['bad']}; "
        f"disconnects {doc['disconnects']}",
        f"ready: {'yes' if doc['ready'] else 'NO'} ({doc['ready_detail']})",
    ]
    outside = doc["outside_groups"]
    refused = {**outside["rejected"], **outside["faults"]}
    if refused:
        shown = ", ".join(f"{k} {n}" for k, n in sorted(refused.items()))
        lines.append(f"refused outside any group: {shown}")
    for group in doc["groups"]:
        block = _relayed_block if group.get("served") == "relays" else _group_block
        lines += ["", *block(group)]
    return "\n".join(lines)


def _group_ready(doc: dict[str, Any]) -> str:
    """A group's readiness word: a stopped group (every rank left cleanly) is not formed but
    counts toward coordd's readiness, so it reads "stopped", never "NO" under coordd's "yes"."""
    if doc["ready"]:
        return "yes"
    if doc.get("left_cleanly") and not doc["failure"]:
        return "stopped, not a failure"
    return "NO"


def _group_block(doc: dict[str, Any]) -> list[str]:
    rounds = doc["rounds"]
    rnd = doc["round"]
    lines = [
        f"group {doc['name']}  dp {doc['dp_size']}  state {doc['state']}"
        f"  epoch {doc['epoch']}  seq {doc['seq']}"
        f"  on rank loss: {doc['on_rank_loss']}  step timeout {_seconds(doc['step_timeout_s'])}",
        f"  ready: {_group_ready(doc)} ({doc['ready_detail']})",
    ]
    if rnd["open"]:
        lines.append(
            f"  round {doc['seq']}: open, {rnd['kind']}, {rnd['reported']}/{doc['dp_size']} "
            f"reported, {_seconds(rnd['age_s'])} old"
        )
    decided = ", ".join(f"{k} {n}" for k, n in sorted(rounds["decided"].items())) or "none"
    failed = sum(rounds["failed"].values())
    lines.append(f"  rounds decided: {decided}; failed: {failed}")
    if doc.get("returns"):
        lines.append(
            f"  back from their own collective (coordd lost or absent): {doc['returns']} rank "
            f"registration(s), the latest after {_seconds(doc['last_away_s'])} without coordd"
        )
    if doc.get("left_cleanly"):
        lines.append(
            f"  STOPPED: every rank left cleanly (Goodbye) at seq {doc['seq']}; not a failure"
        )
    if doc["failure"]:
        f = doc["failure"]
        lines.append(
            f"  FAILED: epoch {f['epoch']} seq {f['seq']} {f['kind']} {f['reason']} "
            f"ranks {f['ranks']}: {f['text']}"
        )
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
    lines += ["  " + line for line in _table(list(RANK_COLUMNS), rows)]
    summary = doc.get("ranks_summary")
    if summary is not None and summary["shown"] < doc["dp_size"]:
        lines.append(
            f"  ({doc['dp_size'] - summary['shown']} more ranks not shown: "
            f"{summary['registered']} registered, {summary['missing']} missing, "
            f"{summary['left out']} left out in all; coordd status --group {doc['name']})"
        )
    lines.append("  " + rank_footnote(doc["lateness_window_rounds"]))
    if doc["recent_failures"]:
        lines.append("  recent failures:")
        for f in doc["recent_failures"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["time"]))
            lines.append(
                f"    {when} epoch {f['epoch']} seq {f['seq']} {f['kind']} {f['reason']} "
                f"ranks {f['ranks']}: {f['text']}"
            )
    return lines


def _relayed_block(doc: dict[str, Any]) -> list[str]:
    """A group the root serves through relays: its relays and the ranks none speaks for
    (per-rank timing is in each relay's own status)."""
    rounds = doc["rounds"]
    lines = [
        f"group {doc['name']}  dp {doc['dp_size']}  state {doc['state']}"
        f"  epoch {doc['epoch']}  seq {doc['seq']}  through {len(doc['relays'])} relays"
        f"  on rank loss: {doc['on_rank_loss']}  step timeout {_seconds(doc['step_timeout_s'])}",
        f"  ready: {_group_ready(doc)} ({doc['ready_detail']})",
        f"  rounds decided: {rounds['decided']}; failed: {rounds['failed']}",
    ]
    if doc["failure"]:
        f = doc["failure"]
        lines.append(
            f"  FAILED: epoch {f['epoch']} seq {f['seq']} {f['kind']} {f['reason']} "
            f"ranks {f['ranks']}: {f['text']}"
        )
    rows = [[r["name"], r["ranks"], r["address"] or "-"] for r in doc["relays"]]
    lines += ["  " + line for line in _table(["RELAY", "RANKS", "ADDRESS"], rows)]
    missing = [r["rank"] for r in doc["ranks"] if r["state"] == "missing"]
    if missing:
        lines.append(f"  no relay speaks for ranks {missing}")
    left_out = [r["rank"] for r in doc["ranks"] if r["state"] == "left out"]
    if left_out:
        lines.append(f"  left out (lost, neutral in every round): ranks {left_out}")
    summary = doc["ranks_summary"]
    if summary["shown"] < doc["dp_size"]:
        lines.append(
            f"  ({summary['missing']} ranks missing in all; coordd status --group {doc['name']})"
        )
    return lines
