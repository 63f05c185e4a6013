"""The chaos processes by role, one module each; `ROLES` names the entry of every role but
the ranks' (`rank_loop.run_rank`: roles "rank" and "raw")."""

from __future__ import annotations

from collections.abc import Callable

from coordd.testing.history import HistoryWriter
from coordd.tools.chaos.roles.claimer import run_claimer
from coordd.tools.chaos.roles.fallback_rank import run_fallback_rank
from coordd.tools.chaos.roles.joiner import run_impostor, run_joiner
from coordd.tools.chaos.roles.outsiders import run_rogue, run_stranger
from coordd.tools.chaos.roles.proxy import run_proxy
from coordd.tools.chaos.roles.rank_loop import run_rank
from coordd.tools.chaos.roles.squatter import run_squatter
from coordd.tools.chaos.roles.taker import run_taker
from coordd.tools.chaos.spec import WorkerSpec

Role = Callable[[WorkerSpec, HistoryWriter], int]

ROLES: dict[str, Role] = {
    "joiner": run_joiner,
    "impostor": run_impostor,
    "garbage": run_rogue,
    "stranger": run_stranger,
    "taker": run_taker,
    "claimer": run_claimer,
    "squatter": run_squatter,
    "proxy": run_proxy,
    "fallback": run_fallback_rank,
}

__all__ = ["ROLES", "Role", "run_rank"]
