"""End-to-end check of the vLLM plugin: stock vLLM with DP=2, with and without coordd, must
generate the same tokens (`python -m coordd.tools.vllm_e2e`; check.py has the whole story).

tiny_model.py writes the model both runs load; engines.py runs vLLM's offline DP mode, one
process per rank; group_metrics.py reads what coordd says of the run; comparison.py sets the
runs side by side; run_options.py is what a run is asked for; check.py parses and runs the check.
"""

from __future__ import annotations

from coordd.tools.vllm_e2e.check import main, parse_args, sidecar, tidy
from coordd.tools.vllm_e2e.comparison import (
    STEP_NOTE,
    RankResult,
    compare,
    side_by_side,
    step_summary,
)
from coordd.tools.vllm_e2e.engines import engine_kwargs, free_port, preflight, rank_env
from coordd.tools.vllm_e2e.group_metrics import (
    ENGINE_GROUP,
    WORKER_GROUP,
    check_metrics,
    parse_rounds,
    scrape,
    wait_stopped,
)
from coordd.tools.vllm_e2e.run_options import MISMATCH, OK, UNAVAILABLE, Options, resolve_device
from coordd.tools.vllm_e2e.tiny_model import PROMPTS, prompts_for, write_tiny_model

__all__ = [
    "ENGINE_GROUP",
    "MISMATCH",
    "OK",
    "PROMPTS",
    "STEP_NOTE",
    "UNAVAILABLE",
    "WORKER_GROUP",
    "Options",
    "RankResult",
    "check_metrics",
    "compare",
    "engine_kwargs",
    "free_port",
    "main",
    "parse_args",
    "parse_rounds",
    "preflight",
    "prompts_for",
    "rank_env",
    "resolve_device",
    "scrape",
    "side_by_side",
    "sidecar",
    "step_summary",
    "tidy",
    "wait_stopped",
    "write_tiny_model",
]
