"""Load generators against a live coordd: every load is bounded in count and time and stops
by itself.

Run one from the command line (it is a separate process, so it does not share the measuring
process's interpreter lock):

    python -m coordd.tools.load garbage ADDRESS --peers 50 --messages 20000 --repeat 3
    python -m coordd.tools.load fast ADDRESS --seconds 5
    python -m coordd.tools.load multipart ADDRESS --parts 2000000
    python -m coordd.tools.load unread ADDRESS --peers 20 --messages 10000
    python -m coordd.tools.load connections ADDRESS --count 1000 --seconds 5   (raw sockets)
    python -m coordd.tools.load http HOST:PORT --count 1000 --seconds 5
    python -m coordd.tools.load claims ADDRESS --count 900 --peers 20 --seconds 5   (id claims)
    python -m coordd.tools.load handshakes tcp://127.0.0.1:PORT --peers 20 --count 200
        (handshakes kept in flight, over tcp from --count loopback addresses; with a leaked
        rank key from $COORDD_CURVE_*)

or all of them with figures: `python -m coordd.tools.load measure --dp 4`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from coordd.tools.load.connection_floods import connections, handshakes, http, storm
from coordd.tools.load.measure import measure
from coordd.tools.load.message_floods import fast, garbage, member, multipart, unread
from coordd.tools.load.processes import LOADS


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordd.tools.load", description=__doc__)
    p.add_argument("kind", choices=(*LOADS, "measure"))
    p.add_argument("address", nargs="?", default="")
    p.add_argument("--peers", type=int, default=50)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--parts", type=int, default=2_000_000)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--only", default="", help="measure: a comma list of loads (default all)")
    p.add_argument("--coordd-args", default="", help="measure: more coordd options, one string")
    p.add_argument("--runs", type=int, default=1, help="measure: runs of each load (spread)")
    args = p.parse_args(argv)
    if args.kind == "measure":
        only = [k for k in args.only.split(",") if k]
        unknown = sorted(set(only) - set(LOADS))
        if unknown:
            p.error(f"--only: unknown loads {unknown}; known: {', '.join(LOADS)}")
        return measure(args.dp, only=only, extra=args.coordd_args.split(), runs=args.runs)
    if args.kind == "garbage":
        n = garbage(args.address, args.peers, args.messages, args.repeat)
    elif args.kind == "fast":
        n = fast(args.address, args.seconds)
    elif args.kind == "multipart":
        n = multipart(args.address, args.parts)
    elif args.kind == "storm":
        n = storm(args.address, args.peers, args.count, args.seconds)
    elif args.kind == "handshakes":
        n = handshakes(args.address, args.peers, args.seconds, sources=args.count)
    elif args.kind == "member":
        n = member(args.address, args.seconds, dp=args.dp)
    elif args.kind == "unread":
        n = unread(args.address, args.peers, args.messages, hold=args.seconds)
    elif args.kind == "connections":
        n = connections(args.address, args.count, args.seconds)
    elif args.kind == "claims":
        from coordd.tools.load.claims import attack

        result = attack(args.address, args.count, args.seconds, in_flight=args.peers)
        print(result.summary(), file=sys.stderr, flush=True)
        n = result.idless_admitted
    else:
        n = http(args.address, args.count, args.seconds)
    print(n, flush=True)
    if args.kind in ("garbage", "handshakes"):
        os._exit(0)  # a context left terming (see term_soon) would hold the exit
    return 0
