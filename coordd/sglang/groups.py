"""Which coordd group an SGLang DP sync belongs to, read from SGLang's own groups and config.

SGLang's DP attention syncs over its whole TP group (every attention-DP rank and its
attention-TP and -CP peers: each writes its own row), one TP group per PP stage; the elastic
path syncs over WORLD. So the plugin makes one coordd group per PP stage, `dp-tpall-pp{p}`, and
`dp-tpall-ppall` for WORLD: both fit coordd's default `--groups` pattern `dp-tp*-pp*`. A
process's rank in a group is its rank in that torch process group; coordd's `--dp` must be at
least the group's size (SGLang's `--tp-size`, or the WORLD size).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as torch_dist

from coordd.vllm.groups import GroupIdentity

#: The group of the elastic WORLD all-reduce.
WORLD_GROUP = "dp-tpall-ppall"
#: Hello.config_fingerprint is a ShortStr.
_MAX_FINGERPRINT = 256

__all__ = ["WORLD_GROUP", "GroupIdentity", "identity_of", "tp_group_name"]


def tp_group_name(pp_rank: int) -> str:
    return f"dp-tpall-pp{pp_rank}"


def _sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def fingerprint(layout: str) -> str:
    """SGLang's version, `layout` (the group's sizes) and, when SGLang's server args are
    published in this process, the model path and dtype: what every rank of one deployment
    shares."""
    parts = [f"sglang-{_sglang_version()}", layout]
    try:
        from sglang.srt.runtime_context import get_server_args

        args: Any = get_server_args()
    except Exception:  # nothing published (a bare process group)
        args = None
    if args is not None:
        parts += [f"model={getattr(args, 'model_path', '')}", f"dtype={getattr(args, 'dtype', '')}"]
    text = " ".join(parts)
    if len(text) > _MAX_FINGERPRINT:
        digest = hashlib.sha256(text.encode()).hexdigest()[:32]
        text = f"{parts[0]} {layout} sha256={digest}"
    return text


def identity_of(group: Any) -> GroupIdentity | None:
    """The coordd group of a sync on torch process group `group`: SGLang's TP group (its cpu or
    device group) or WORLD; None for any other group (the sync then keeps SGLang's path)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if group is None or group is torch_dist.group.WORLD:
        name = WORLD_GROUP
    else:
        try:
            tp = parallel.tp_group
        except Exception:  # SGLang's groups are not built in this process
            return None
        if group is not tp.cpu_group and group is not tp.device_group:
            return None
        name = tp_group_name(int(parallel.pp_rank))
    size = torch_dist.get_world_size(group)
    rank = torch_dist.get_rank(group)
    try:
        layout = (
            f"{name} size={size} tp={parallel.tp_size} dp={parallel.attn_dp_size} "
            f"attn_tp={parallel.attn_tp_size} attn_cp={parallel.attn_cp_size} "
            f"pp={parallel.pp_size}"
        )
    except Exception:  # widths not published: the group's size alone
        layout = f"{name} size={size}"
    return GroupIdentity(name, rank, size, fingerprint(layout))
