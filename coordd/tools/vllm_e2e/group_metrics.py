"""What coordd says of the run: its gather rounds per group (/metrics) and each group's state
(/status)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping, Sequence

#: The coordd groups one vLLM deployment with TP=PP=1 forms (coordd.vllm's names).
WORKER_GROUP = "dp-tp0-pp0"
ENGINE_GROUP = "enginecore"


# -- coordd's /metrics --------------------------------------------------------------------------


def parse_rounds(text: str) -> dict[str, dict[str, int]]:
    """`coordd_rounds_total` from a /metrics page: {group: {"<kind>:<outcome>": count}}. A
    coordd without a group label counts as one group named ""."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "coordd_rounds":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = f"{labels.get('kind', '')}:{labels.get('outcome', '')}"
            group = out.setdefault(labels.get("group", ""), {})
            group[key] = group.get(key, 0) + int(sample.value)
    return out


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def check_metrics(
    rounds: Mapping[str, Mapping[str, int]], groups: Sequence[str] = (WORKER_GROUP, ENGINE_GROUP)
) -> list[str]:
    """What is wrong with coordd's counts after a plugin run (empty: every sync went through
    coordd): each group has completed rounds, and no round failed."""
    problems = []
    for group in groups:
        counts = rounds.get(group, {})
        done = sum(n for key, n in counts.items() if not key.endswith(":failed"))
        if done <= 0:
            problems.append(f"coordd counted no round for group {group!r} (saw {dict(rounds)})")
    for group, counts in rounds.items():
        failed = {k: n for k, n in counts.items() if k.endswith(":failed") and n}
        if failed:
            problems.append(f"group {group!r} has failed rounds: {failed}")
    return problems


def group_states(url: str) -> dict[str, str]:
    """Every group's state from coordd's /status (e.g. {"enginecore": "stopped"})."""
    with urllib.request.urlopen(url + "/status", timeout=5) as response:
        doc = json.loads(response.read().decode())
    return {g["name"]: g["state"] for g in doc["groups"]}


def wait_stopped(url: str, groups: Sequence[str], timeout: float = 20.0) -> dict[str, str]:
    """The groups' states once every one in `groups` is stopped or failed (or at the
    deadline): the ranks' clean exit must leave each stopped."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while True:
        try:
            states = group_states(url)
        except OSError:
            states = {}
        done = all(states.get(g) in ("stopped", "failed") for g in groups)
        if done or time.monotonic() > deadline:
            return states
        time.sleep(0.2)
