"""coordd's SGLang plugin: stock SGLang 0.5.23 runs every DP attention sync through coordd.

Install and enable
------------------
Installing coordd into SGLang's environment (``pip install --no-deps /path/to/coordd`` beside
SGLang, whose dependencies include coordd's) registers the entry point
``coordd = "coordd.sglang:register"`` in SGLang's plugin group ``sglang.srt.plugins``; SGLang's
``load_plugins()`` calls it in every scheduler process. It does nothing unless enabled by the
environment of those processes:

- ``COORDD_ADDRESS=ipc:///run/coordd/coordd.sock`` (or ``tcp://host:port``) turns it on and says
  where coordd listens; ``COORDD_SGLANG=1`` turns it on with coordd's default ipc path;
  ``COORDD_SGLANG=0`` keeps it off even if ``COORDD_ADDRESS`` is set.
- ``COORDD_SGLANG_CONNECT_TIMEOUT`` (seconds, default 60): how long a group's first sync waits
  for coordd's Welcome. ``COORDD_SGLANG_SYNC_TIMEOUT`` (default 120): how long one sync waits
  for its round; keep it above coordd's ``--step-timeout``.
- SGLang's own ``SGLANG_PLUGINS`` allowlist applies: if it is set, it must include ``coordd``.

coordd runs with ``--dp`` at least SGLang's ``--tp-size`` (the sync's group is SGLang's whole TP
group). The groups, ``dp-tpall-pp{p}`` per PP stage and ``dp-tpall-ppall`` for the elastic WORLD
path, fit coordd's default ``--groups`` pattern ``dp-tp*-pp*`` (``coordd.sglang.groups``).

What it patches
---------------
Only the collective under each sync (``coordd.sglang.patches``): SGLang's
``MLPSyncBatchInfo.all_gather`` still builds its rows and decides everything from the result.
Every rank writes only its own row, so a coordd gather round of that row gives every rank the
same tensor gloo or NCCL would (``coordd.sglang.rows``). A rank that skips a sync and makes
another, or syncs from another place, makes every rank raise coordd's ``StepMismatch`` naming
it; a rank that stops syncing is named by ``StepTimeout`` after coordd's ``--step-timeout`` (or
``RankLost`` by its heartbeat), where gloo waits.

Any other SGLang release, or one whose code differs from what the patches expect, gets one
warning and an untouched SGLang.
"""

from __future__ import annotations


def register() -> None:
    """SGLang's general-plugin entry point: install the patches if the environment enables the
    plugin. Cheap and idempotent; no socket is opened until a group's first sync."""
    from coordd.sglang.enable import settings_from_env

    settings = settings_from_env()
    if settings is None:
        return
    from coordd.sglang.patches import install

    install(settings)


__all__ = ["register"]
