"""The GPU end-to-end check's parts that need no GPU: the tiny model directory and its tokenizer,
the arguments, each rank's environment, reading coordd's /metrics, and the comparison."""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from pathlib import Path

import pytest

from coordd.testing import CoorddProcess
from coordd.tools import vllm_e2e as e2e


def test_the_tiny_model_directory_is_complete_and_consistent(tmp_path: Path) -> None:
    model = e2e.write_tiny_model(tmp_path / "model")
    names = {p.name for p in model.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    config = json.loads((model / "config.json").read_text())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert config["vocab_size"] == len(vocab) == len(set(vocab.values()))
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_local_experts"] > 0, "vLLM runs DP syncs only for a model it calls MoE"
    for special, key in (("<s>", "bos_token_id"), ("</s>", "eos_token_id"),
                         ("<pad>", "pad_token_id")):
        assert vocab[special] == config[key]
    for prompt in e2e.PROMPTS:
        assert all(word in vocab for word in prompt.split()), prompt
    moe = json.loads((e2e.write_tiny_model(tmp_path / "moe", moe=True) / "config.json")
                     .read_text())
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["model_type"] == "mixtral"


def test_the_tokenizer_file_loads_and_round_trips(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers (a vLLM dependency)")
    model = e2e.write_tiny_model(tmp_path / "model")
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    for prompt in e2e.PROMPTS:
        ids = tok.encode(prompt).ids
        assert 0 not in ids, "no word is unknown"
        assert tok.decode(ids) == prompt


def test_prompts_are_split_across_ranks_unevenly() -> None:
    parts = [e2e.prompts_for(r, 2) for r in range(2)]
    assert sorted(p for part in parts for p in part) == sorted(e2e.PROMPTS)
    assert {len(p.split()) for p in parts[0]} != {len(p.split()) for p in parts[1]}


def test_arguments() -> None:
    assert e2e.parse_args([]) == e2e.Options()
    opts = e2e.parse_args(["--gpus", "2", "--moe", "--runner", "v1", "--eager"])
    assert (opts.gpus, opts.moe, opts.runner, opts.eager) == (2, True, "v1", True)
    for bad in (["--dp", "1"], ["--moe"], ["--dp", "4", "--gpus", "3"],
                ["--gpu-memory-utilization", "0.6"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_each_rank_gets_vllms_dp_variables_and_the_plugin_switch() -> None:
    opts = e2e.Options()
    base = {"PATH": "/bin", "COORDD_ADDRESS": "ipc:///stale.sock"}
    off = e2e.rank_env(opts, 1, 4321, address=None, base=base)
    assert (off["VLLM_DP_RANK"], off["VLLM_DP_SIZE"], off["VLLM_DP_MASTER_PORT"]) == (
        "1", "2", "4321")
    assert off["VLLM_DP_RANK_LOCAL"] == "0", "both ranks on GPU 0"
    assert off["VLLM_DISABLE_PYNCCL"] == "1"
    assert off["COORDD_VLLM"] == "0" and "COORDD_ADDRESS" not in off
    on = e2e.rank_env(opts, 0, 4321, address="ipc:///tmp/c.sock", base=base)
    assert (on["COORDD_VLLM"], on["COORDD_ADDRESS"]) == ("1", "ipc:///tmp/c.sock")
    spread = e2e.rank_env(e2e.Options(gpus=2), 1, 4321, address=None, base=base)
    assert spread["VLLM_DP_RANK_LOCAL"] == "1" and "VLLM_DISABLE_PYNCCL" not in spread
    assert e2e.rank_env(e2e.Options(runner="v2"), 0, 1, address=None,
                        base=base)["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_on_cpu_each_rank_gets_its_own_core_and_a_small_kv_cache() -> None:
    opts = e2e.resolve_device(e2e.Options(device="cpu"))
    assert opts.eager, "CPU runs eager"
    envs = [e2e.rank_env(opts, r, 4321, address=None, base={}) for r in range(2)]
    assert [env["VLLM_DP_RANK_LOCAL"] for env in envs] == ["0", "1"]
    binds = {env["VLLM_CPU_OMP_THREADS_BIND"] for env in envs}
    assert len(binds) == 1, "one list for all, vLLM takes the local rank's entry"
    cores = binds.pop().split("|")
    assert len(cores) == 2 and all(c.isdigit() for c in cores)
    if len(os.sched_getaffinity(0)) > 1:
        assert cores[0] != cores[1], "one core per rank"
    assert all(env["VLLM_CPU_KVCACHE_SPACE"] == "1" for env in envs)
    assert all("VLLM_DISABLE_PYNCCL" not in env for env in envs)
    kw = e2e.engine_kwargs(opts, Path("/m"))
    assert kw["enforce_eager"] is True and "kv_cache_memory_bytes" not in kw
    assert "compilation_config" not in kw and "gpu_memory_utilization" not in kw
    assert e2e.parse_args(["--device", "cpu"]).device == "cpu"


def test_engine_arguments_keep_the_ranks_off_nccl() -> None:
    kw = e2e.engine_kwargs(e2e.Options(), Path("/m"))
    assert kw["load_format"] == "dummy" and kw["disable_nccl_for_dp_synchronization"] is True
    assert kw["disable_custom_all_reduce"] is True and kw["kv_cache_memory_bytes"] > 0


METRICS = """\
# HELP coordd_rounds_total Rounds ended, by group, kind and outcome
# TYPE coordd_rounds_total counter
coordd_rounds_total{group="dp-tp0-pp0",kind="gather",outcome="decided"} 412.0
coordd_rounds_total{group="enginecore",kind="gather",outcome="decided"} 9.0
coordd_rounds_total{group="enginecore",kind="gather",outcome="failed"} 0.0
# HELP coordd_epoch Epoch
# TYPE coordd_epoch gauge
coordd_epoch{group="enginecore"} 1.0
"""


def test_metrics_prove_every_group_went_through_coordd() -> None:
    rounds = e2e.parse_rounds(METRICS)
    assert rounds == {"dp-tp0-pp0": {"gather:decided": 412},
                      "enginecore": {"gather:decided": 9, "gather:failed": 0}}
    assert e2e.check_metrics(rounds) == []
    missing = e2e.check_metrics({"dp-tp0-pp0": {"gather:decided": 3}})
    assert len(missing) == 1 and "enginecore" in missing[0]
    failed = e2e.check_metrics({**rounds, "enginecore": {"gather:decided": 2,
                                                         "gather:failed": 1}})
    assert len(failed) == 1 and "failed rounds" in failed[0]


def test_a_real_coordds_metrics_page_parses(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with CoorddProcess(2, f"ipc://{tmp_path}/c.sock", ["--metrics-port", str(port)]):
        text = e2e.scrape(f"http://127.0.0.1:{port}/metrics")
    rounds = e2e.parse_rounds(text)
    assert all(n == 0 for counts in rounds.values() for n in counts.values())
    assert len(e2e.check_metrics(rounds)) == 2, "no round yet: both groups missing"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def result(rank: int, tokens: list[list[int]], **kw: object) -> e2e.RankResult:
    return e2e.RankResult(rank, tokens, step_seconds=[0.01, 0.02], seconds=1.0, **kw)  # type: ignore[arg-type]


def test_the_comparison_names_rank_prompt_and_position() -> None:
    plain = [result(0, [[1, 2, 3], [4, 5]]), result(1, [[6, 7]])]
    assert e2e.compare(plain, plain) == []
    changed = [result(0, [[1, 2, 3], [4, 9]]), result(1, [[6, 7]])]
    (problem,) = e2e.compare(plain, changed)
    assert "rank 0 prompt 1" in problem and "position 1" in problem
    short = [result(0, [[1, 2, 3]]), result(1, [[6, 7]])]
    assert "1 with" in e2e.compare(plain, short)[0]
    broken = [result(0, [], error="RankLost: rank 1"), result(1, [[6, 7]])]
    assert e2e.compare(plain, broken) == ["rank 0 with coordd failed: RankLost: rank 1"]
    assert "rank 1: no result" in e2e.compare(plain, plain[:1])[0]


def test_step_times_side_by_side() -> None:
    plain = [result(0, [[1]]), result(1, [[2]])]
    text = e2e.side_by_side(plain, plain)
    assert "vLLM (gloo)" in text and "vLLM + coordd" in text
    steps = next(line for line in text.splitlines() if line.startswith("engine steps"))
    assert steps.split()[-2:] == ["4", "4"]
    assert e2e.step_summary([])["steps"] == 0


def test_without_vllm_or_a_gpu_it_says_why_and_exits_2(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    why = e2e.preflight("cuda")
    if why is None:
        pytest.skip("this machine can run the check")
    assert e2e.main(["--device", "cuda"]) == e2e.UNAVAILABLE
    assert "cannot run here" in capsys.readouterr().err


def test_the_step_table_says_what_its_figures_include() -> None:
    plain = [result(0, [[1]]), result(1, [[2]])]
    assert e2e.STEP_NOTE in e2e.side_by_side(plain, plain)


def test_the_sync_table_pools_each_modes_timed_steps(tmp_path: Path) -> None:
    """coordd.tools.vllm_steps: steps with a sync only, a cut line skipped, p10/p50/p90 by
    nearest rank below, round = window + wait, cost = sync + start, ratios per quantile."""
    from coordd.tools import vllm_steps

    lines = {
        "stock": [dict(sync=0.002 * k, step=0.01 * k) for k in range(1, 11)],
        "off": [dict(sync=0.004 * k, wait=0.003 * k, step=0.02 * k) for k in range(1, 11)],
        "on": [
            dict(sync=0.001 * k, start=0.001, window=0.0005, wait=0.0005 * k, step=0.01 * k)
            for k in range(1, 11)
        ],
    }
    (tmp_path / "run1").mkdir()
    with (tmp_path / "run1" / "steps-1.jsonl").open("w") as out:
        for mode, steps in lines.items():
            for step in steps:
                out.write(json.dumps({"mode": mode, **step}) + "\n")
        out.write(json.dumps({"mode": "on", "sync": 0.0, "step": 0.5}) + "\n")  # no sync
        out.write('{"mode": "on", "sy')  # a killed process's last line
    steps = vllm_steps.read_steps([tmp_path / "run1"])
    assert {mode: len(rows) for mode, rows in steps.items()} == {"stock": 10, "off": 10, "on": 10}
    stats = vllm_steps.summary(steps)
    assert stats["stock"]["sync"] == pytest.approx([0.004, 0.012, 0.020])
    assert stats["on"]["round"][1] == pytest.approx(0.0005 + 0.003)
    assert stats["on"]["cost"][1] == pytest.approx(0.006 + 0.001)
    text = vllm_steps.table(steps)
    ratio = next(line for line in text.splitlines() if line.startswith("coordd, overlap on / c"))
    assert "sync 0.25/0.25/0.25" in ratio and "step 0.50/0.50/0.50" in ratio, ratio
    assert "cost 0.38/0.29/" in ratio, ratio
    assert vllm_steps.main([str(tmp_path / "empty")]) == 1


def test_the_per_set_ratios_pair_the_modes_within_each_set(tmp_path: Path) -> None:
    from coordd.tools import vllm_steps

    sets = []
    for k, (off, on) in enumerate([(0.004, 0.002), (0.002, 0.002), (0.001, 0.004)], 1):
        dirs = {}
        for mode, sync in (("off", off), ("on", on)):
            d = tmp_path / f"set{k}-{mode}"
            d.mkdir()
            line = json.dumps({"mode": mode, "sync": sync, "step": 0.01})
            (d / "steps-1.jsonl").write_text((line + "\n") * 5)
            dirs[mode] = d
        sets.append(dirs)
    text = vllm_steps.per_set(sets)
    assert "set 3 (p50 ms): off sync 1.00 cost 1.00 step 10.00; on sync 4.00" in text, text
    assert "per-set p50 ratio on/off cost across 3 sets (p10/p50/p90): 0.50/1.00/4.00" in text


def test_a_plugin_runs_coordd_writes_its_log_beside_the_rank_logs(tmp_path: Path) -> None:
    """Issue 39, item 3: coordd ran at --log-level warning with stderr inherited, so its
    lines (a registration, a stop) could not be looked up after the run, even with --keep."""
    from coordd.client import CoordClient

    run_dir = tmp_path / "coordd"
    with e2e.sidecar(2, run_dir) as coordd, CoordClient(
        coordd.address, dp_rank=0, dp_size=2, group="dp-tp0-pp0"
    ) as client:
        client.connect(timeout=10.0)
    log = (run_dir / "coordd.log").read_text()
    assert "rank registered group=dp-tp0-pp0" in log, log
    assert "coordd stopped" in log, log


def test_the_work_directory_goes_only_after_a_pass_without_keep(tmp_path: Path) -> None:
    """The first line said "model and logs in DIR" and a passing run removed DIR unasked;
    the last lines now say which happened, and how to keep them."""
    for keep, problems, stays in ((None, [], False), (None, ["rank 1 differs"], True),
                                  ("kept", [], True)):
        work = tmp_path / f"w-{keep}-{len(problems)}"
        (work / "coordd").mkdir(parents=True)
        (work / "coordd" / "coordd.log").write_text("coordd stopped\n")
        said = e2e.tidy(work, keep, problems)
        assert work.exists() is stays
        assert said == (f"vllm_e2e: logs kept in {work} (each run's rank<N>.log, and coordd.log)"
                        if stays else
                        f"vllm_e2e: removed {work} (--keep DIR keeps the model and logs)")
        page = " ".join((Path(__file__).parents[2] / "docs" / "vllm.md").read_text().split())
        assert f"`{said.replace(str(work), 'DIR')}`" in page, "docs/vllm.md quotes both lines"
