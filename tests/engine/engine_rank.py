"""One DP rank of the real-engine test: a vLLM offline engine (its own process, `VLLM_DP_*` in
its environment, as coordd.tools.vllm_e2e starts it) that generates the fixed prompts greedily,
one `engine.step()` at a time, and tells the test where it is through files in `--dir`:

  rank{r}.job{j}.progress  "<steps done> <wall time>" after every step of round j (the test
                           stops or kills a rank mid-decode by watching it)
  rank{r}.json             one result per round: tokens, step times, or the error the engine
                           raised and when (a rank whose engine failed exits at once)
  barrier{j}/rank{r}       written when round j is done; the rank waits (bounded) for every
                           rank, then for `go{j+1}` (the next round) or, after the last, for
                           `release` (the test reads coordd's /metrics meanwhile), and exits
                           normally: vLLM's own shutdown, the plugin's Goodbye

    python -m tests.engine.engine_rank --rank R --dir DIR --model MODEL --options JSON [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coordd.tools.vllm_e2e import Options, engine_kwargs, prompts_for

#: Seconds a finished rank waits for the others, then for the test's word, before it exits.
BARRIER_WAIT = 120.0
RELEASE_WAIT = 60.0


@dataclass
class Result:
    rank: int
    tokens: list[list[int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    started_at: float = 0.0
    #: The engine's error (`Type: text`), and the wall time it was raised; "" when none.
    error: str = ""
    error_at: float = 0.0
    trace: str = ""


def run(rank: int, work: Path, model: Path, options: Options, jobs: int) -> int:
    """`jobs` rounds of the same prompts on one engine; before round j > 1 the rank waits for
    the test's `go{j}` file (so the test can stop or kill a rank mid-decode of round j)."""
    results: list[Result] = []
    out = work / f"rank{rank}.json"
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(options, model))
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=options.max_tokens, ignore_eos=True)
        prompts = prompts_for(rank, options.dp)
    except BaseException as exc:
        results.append(_failed(Result(rank), exc))
        out.write_text(json.dumps([asdict(r) for r in results]))
        return 1
    for job in range(1, jobs + 1):
        if job > 1 and not _wait_for(work / f"go{job}", RELEASE_WAIT):
            break
        result = Result(rank)
        results.append(result)
        progress = work / f"rank{rank}.job{job}.progress"
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{job}-{i}", prompt, params)
            done: dict[str, Any] = {}
            result.started_at = time.time()
            steps = 0
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                outputs = engine.step()
                result.step_seconds.append(time.perf_counter() - t)
                steps += 1
                progress.write_text(f"{steps} {time.time()}\n")
                for output in outputs:
                    if getattr(output, "finished", False):
                        done[str(output.request_id)] = output
            result.tokens = [
                list(done[f"{job}-{i}"].outputs[0].token_ids) for i in range(len(prompts))
            ]
        except BaseException as exc:  # reported to the test; the rank then exits at once
            _failed(result, exc)
            out.write_text(json.dumps([asdict(r) for r in results]))
            return 1
        out.write_text(json.dumps([asdict(r) for r in results]))
        barrier = work / f"barrier{job}"
        barrier.mkdir(exist_ok=True)
        (barrier / f"rank{rank}").touch()
        deadline = time.monotonic() + BARRIER_WAIT
        while time.monotonic() < deadline and len(list(barrier.iterdir())) < options.dp:
            time.sleep(0.1)
    _wait_for(work / "release", RELEASE_WAIT)
    return 0


def _failed(result: Result, exc: BaseException) -> Result:
    result.error = f"{type(exc).__name__}: {exc}"
    result.error_at = time.time()
    result.trace = traceback.format_exc()[-4000:]
    return result


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--options", required=True)
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args(argv)
    return run(a.rank, Path(a.dir), Path(a.model), Options(**json.loads(a.options)), a.jobs)


if __name__ == "__main__":
    sys.exit(main())
