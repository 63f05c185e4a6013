"""What loading the plugin costs a fresh vLLM process: CPU, wall and the modules it imports.

Each context is a fresh Python that first imports what a vLLM process of that kind has loaded
when vLLM loads its plugins, then calls the entry point vLLM calls (`coordd.vllm.register`,
with COORDD_ADDRESS set: nothing listens, and the install opens no socket):

  vllm      `import vllm` and its config: the least any vLLM process has
  worker    a multiproc worker before `init_worker` (its executor and worker base modules)
  engine    an engine core (`vllm.v1.engine.core`, which calls load_general_plugins)

    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu <vLLM venv>/bin/python -m tests.vllm.install_cost

prints one line per context and run: CPU and wall ms of the register call, the modules it
added, and which patch points' modules among them (`patches.POINT_MODULES`). CPU is
`time.process_time` (this process only); wall moves with the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONTEXTS = {
    "vllm": ["vllm", "vllm.config"],
    "worker": ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.worker_base"],
    "engine": ["vllm.v1.engine.core"],
}

#: Run in the fresh process: `{imports}` first, then the timed register call.
_PROBE = """
import importlib, json, sys, time
for name in {imports!r}:
    importlib.import_module(name)
before = set(sys.modules)
w0, c0 = time.perf_counter(), time.process_time()
import coordd.vllm
coordd.vllm.register()
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
from coordd.vllm import patches
added = sorted(set(sys.modules) - before)
points = {{p: n for p, n in getattr(patches, "POINT_MODULES", {{
    "A": "vllm.v1.worker.dp_utils", "B": "vllm.v1.worker.gpu.dp_utils",
    "C-E": "vllm.config.parallel", "F": "vllm.v1.engine.core"}}).items()}}
print(json.dumps(dict(installed=patches.installed(), cpu_ms=cpu * 1e3, wall_ms=wall * 1e3,
    added=len(added), vllm_added=sum(m.startswith("vllm") for m in added),
    points_imported=sorted(p for p, n in points.items() if n in added))))
"""


def probe(context: str, timeout: float = 300.0) -> dict[str, object]:
    """One fresh process in `context`: the register call's cost (see the module docstring)."""
    env = {**os.environ, "COORDD_ADDRESS": "ipc:///nonexistent/coordd-install-cost.sock"}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(imports=CONTEXTS[context])],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{context}: the probe failed: {done.stderr[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default=",".join(CONTEXTS))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    import vllm

    print(f"vLLM {vllm.__version__}, {sys.executable}")
    for context in args.contexts.split(","):
        for run in range(args.runs):
            got = probe(context)
            print(
                f"{context:>7} run {run}: installed={got['installed']} "
                f"cpu {got['cpu_ms']:.0f} ms, wall {got['wall_ms']:.0f} ms, "
                f"{got['added']} modules added ({got['vllm_added']} vllm.*), "
                f"point modules imported: {got['points_imported'] or 'none'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
