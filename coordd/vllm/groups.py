"""Which coordd group a vLLM DP sync belongs to, read from vLLM's own groups and config.

vLLM builds one DP group per (TP, PP, PCP) position: with TP=2 two workers share each DP rank,
one in each DP group, so each position is its own coordd group (`dp-tp{t}-pp{p}`, plus
`-pcp{n}` when PCP > 1). The engine cores (one per DP rank, state syncs only) form group
`enginecore`. The DP rank inside a group is vLLM's rank in that DP group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

#: The engine cores' group (ParallelConfig.sync_dp_state, has_unfinished_dp, ...).
ENGINE_GROUP = "enginecore"
#: Hello.config_fingerprint is a ShortStr (at most 256 characters).
_MAX_FINGERPRINT = 256


@dataclass(frozen=True)
class GroupIdentity:
    """One coordd group as this process sees it: its name, this process's rank in it, its size
    and the fingerprint every rank of it must share."""

    name: str
    dp_rank: int
    dp_size: int
    fingerprint: str


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def config_fingerprint(layout: str) -> str:
    """`layout` (the group's sizes), vLLM's version and, when vLLM's current config is set
    (it is during the profile run, where a worker's first DP sync happens), the model, dtype,
    max_model_len and vLLM's own DP-validation hash of the parallel config (which leaves out
    ranks, ports and addresses): fields every DP rank of one deployment shares."""
    parts = [f"vllm-{_vllm_version()}", layout]
    try:
        from vllm.config import get_current_vllm_config_or_none

        config: Any = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - older vLLM
        config = None
    model = getattr(config, "model_config", None)
    if model is not None:
        parts += [
            f"model={getattr(model, 'model', '')}",
            f"dtype={getattr(model, 'dtype', '')}",
            f"len={getattr(model, 'max_model_len', '')}",
        ]
    parallel = getattr(config, "parallel_config", None)
    if parallel is not None and hasattr(parallel, "compute_hash"):
        parts.append(f"parallel={str(parallel.compute_hash())[:16]}")
    text = " ".join(parts)
    if len(text) > _MAX_FINGERPRINT:
        digest = hashlib.sha256(text.encode()).hexdigest()[:32]
        text = f"{parts[0]} {layout} sha256={digest}"
    return text


def worker_group() -> GroupIdentity:
    """This worker's DP group (vLLM's `get_dp_group()`), named by its TP/PP/PCP position."""
    from vllm.distributed import parallel_state as ps

    dp = ps.get_dp_group()
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    pcp = ps.get_pcp_group()
    name = f"dp-tp{tp.rank_in_group}-pp{pp.rank_in_group}"
    if pcp.world_size > 1:
        name += f"-pcp{pcp.rank_in_group}"
    layout = f"dp={dp.world_size} tp={tp.world_size} pp={pp.world_size} pcp={pcp.world_size}"
    return GroupIdentity(name, dp.rank_in_group, dp.world_size, config_fingerprint(layout))


def engine_group(process_group: Any) -> GroupIdentity:
    """The group of a DP process group that vLLM's engine-state syncs run on.

    That is the engine cores' stateless DP group (`ENGINE_GROUP`); an offline LLMEngine under
    the external launcher passes the workers' own DP cpu_group instead, which is then named
    after the worker's position (`dp-tp0-pp0-engine`), so TP peers do not collide."""
    from vllm.distributed import parallel_state as ps

    name = ENGINE_GROUP
    dp = getattr(ps, "_DP", None)
    if dp is not None and process_group is getattr(dp, "cpu_group", None):
        name = worker_group().name + "-engine"
    size = int(process_group.size())
    return GroupIdentity(
        name, int(process_group.rank()), size, config_fingerprint(f"engine dp={size}")
    )
