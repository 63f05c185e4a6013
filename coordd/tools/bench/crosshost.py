"""Across hosts: a MODEL of each method's round when its ranks are spread over several nodes.

This machine cannot add network delay (no netem), so the bench measures each method's local
cost (over tcp between two network namespaces where it can, else on one host) and models the
rest: the round's critical path crosses the network a number of times in sequence, each
crossing one one-way trip (RTT/2). Ranks sit on the nodes in contiguous blocks (node k holds
ranks k*dp/n .. (k+1)*dp/n - 1, as vLLM numbers DP ranks across nodes); coordd and the hubs run
on node 0. Crossings are counted by walking each algorithm's dependency graph, with a crossing
costing 1 and a hop within a node 0:

- coordd, pyzmq hub, floor (a star): a report to the hub, the decision back: 2 one-way trips,
  1 RTT, whatever dp and n.
- gloo all_reduce (ring: reduce-scatter then all-gather): 2(dp-1) steps, each forwarding what
  the step before received from the left neighbour; the longest chain of dependencies crosses
  a node boundary every dp/n hops: 1 + floor((2(dp-1) - 1) / (dp/n)) one-way trips.
- vLLM cpu_all_reduce_ (recursive doubling): log2(dp) pairwise exchanges (rank r with r XOR
  2^k), each one one-way trip when the pair spans nodes; with contiguous blocks only the
  exchanges with 2^k >= dp/n do: log2(n) one-way trips (plus one block exchange when dp is
  not a power of two).

modelled round = measured local p50 (the lower of across namespaces and one host) + one-way
trips x RTT/2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from coordd.tools.bench.methods import COORDD_IPC, COORDD_TCP, FLOOR, GLOO, HUB, VLLM

NODES = (2, 4)
RTTS_US = (50.0, 200.0)
#: The model's methods, each with the rule its crossings follow.
STAR, RING, DOUBLING = "star (1 round trip)", "ring, 2(dp-1) steps", "recursive doubling"
ALGORITHM = {COORDD_TCP: STAR, HUB: STAR, FLOOR: STAR, GLOO: RING, VLLM: DOUBLING}


def _node(rank: int, dp: int, nodes: int) -> int:
    return rank * nodes // dp


def _cost(a: int, b: int, dp: int, nodes: int) -> int:
    return int(_node(a, dp, nodes) != _node(b, dp, nodes))


def star_trips(dp: int, nodes: int) -> int:
    """Reports in, then the decision out: the farthest rank's report and its reply."""
    far = max(_cost(r, 0, dp, nodes) for r in range(dp))
    return 2 * far


def ring_trips(dp: int, nodes: int) -> int:
    """Longest dependency chain of a ring all-reduce: at step k rank r sends what it got from
    r-1 at step k-1, so t[r](k) = max(t[r](k-1), t[r-1](k-1) + crossing(r-1, r))."""
    t = [0] * dp
    for _ in range(2 * (dp - 1)):
        t = [max(t[r], t[r - 1] + _cost((r - 1) % dp, r, dp, nodes)) for r in range(dp)]
    return max(t)


def doubling_trips(dp: int, nodes: int) -> int:
    """vLLM's `cpu_all_reduce_`: recursive doubling inside power-of-two blocks, then one
    exchange between the blocks (every lane at once)."""
    block = dp & -dp
    t = [0] * dp
    mask = 1
    while mask < block:
        t = [max(t[r], t[r ^ mask] + _cost(r, r ^ mask, dp, nodes)) for r in range(dp)]
        mask <<= 1
    if dp // block > 1:
        t = [
            max(
                t[b * block + r % block] + _cost(r, b * block + r % block, dp, nodes)
                for b in range(dp // block)
            )
            for r in range(dp)
        ]
    return max(t)


TRIPS: dict[str, Callable[[int, int], int]] = {
    STAR: star_trips,
    RING: ring_trips,
    DOUBLING: doubling_trips,
}


def _base(
    method: str, dp: int, measured: Sequence[dict[str, Any]], local: Sequence[dict[str, Any]]
) -> tuple[float, str] | None:
    """The method's local p50: the lower of its p50 across namespaces (tcp) and on one host
    (a crowded machine only ever adds, and it adds most to whatever spins, as gloo's p2p
    does), and where it was measured."""
    found: list[tuple[float, str]] = []
    for row in measured:
        if row["dp"] == dp and row["method"] == method:
            found.append((row["p50_us"], "netns tcp"))
    names = (COORDD_TCP, COORDD_IPC) if method == COORDD_TCP else (method,)
    for name in names:
        rows = [r for r in local if r["dp"] == dp and r["method"] == name]
        if rows:
            where = "one host" + (", ipc" if name == COORDD_IPC else "")
            found.append((rows[0]["p50_us"], where))
            break
    return min(found) if found else None


def model(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method and dp (dp a multiple of the node count): the trips and the modelled p50."""
    measured = results.get("crosshost", [])
    local = results.get("latency", [])
    dps = sorted({r["dp"] for r in [*measured, *local]})
    rows = []
    for method, algorithm in ALGORITHM.items():
        for dp in dps:
            base = _base(method, dp, measured, local)
            if base is None:
                continue
            row: dict[str, Any] = {
                "method": method,
                "algorithm": algorithm,
                "dp": dp,
                "base_p50_us": base[0],
                "base_from": base[1],
            }
            for nodes in NODES:
                if dp < nodes or dp % nodes:
                    continue
                trips = TRIPS[algorithm](dp, nodes)
                row[f"trips_{nodes}n"] = trips
                for rtt in RTTS_US:
                    row[f"p50_{nodes}n_{rtt:g}us"] = base[0] + trips * rtt / 2
            rows.append(row)
    return rows
