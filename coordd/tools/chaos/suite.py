"""The chaos suite: every fault kind with every seed, a few scenarios at a time in threads;
each scenario owns its processes and ends all of them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from coordd.testing.checker import ScenarioResult
from coordd.tools.chaos.scenario_run import ScenarioRun
from coordd.tools.chaos.scenarios import SCENARIOS
from coordd.tools.chaos.spec import Fault, Settings


def run_scenario(fault: Fault, seed: int, settings: Settings, directory: str) -> ScenarioResult:
    return ScenarioRun(SCENARIOS[fault], seed, settings, directory).execute()


def run_suite(
    faults: Iterable[Fault],
    seeds: Iterable[int],
    settings: Settings,
    *,
    parallel: int = 2,
    keep: str | None = None,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Every fault with every seed, `parallel` scenarios at a time; results in submission order.

    Scenario directories go under `keep` (kept), else a temporary directory that is removed,
    except for the scenarios that failed, whose directories are kept and named in the result.
    """
    base = keep or tempfile.mkdtemp(prefix="cc-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    jobs = [(f, s) for f in faults for s in seeds]
    results: list[ScenarioResult] = []
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [
            pool.submit(run_scenario, f, s, settings, os.path.join(base, f"{f.value}-{s}"))
            for f, s in jobs
        ]
        try:
            for future in futures:
                result = future.result()
                results.append(result)
                if on_result is not None:
                    on_result(result)
        except BaseException:  # Ctrl-C: start nothing new; the running ones end their processes
            for future in futures:
                future.cancel()
            raise
    if keep is None:
        for result in results:
            if result.ok or result.skipped:
                shutil.rmtree(result.directory, ignore_errors=True)
        if not os.listdir(base):
            os.rmdir(base)
    return results
