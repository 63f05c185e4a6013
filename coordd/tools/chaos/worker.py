"""One chaos process, started by the runner as `python -m coordd.tools.chaos.worker SPEC.json`:
it reads its `WorkerSpec` and plays the role the spec names (see `coordd.tools.chaos.roles`).
"""

from __future__ import annotations

import sys

import msgspec

from coordd.testing.history import HistoryWriter
from coordd.tools.chaos.roles import ROLES, run_rank
from coordd.tools.chaos.spec import WorkerSpec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=WorkerSpec)
    log = HistoryWriter(spec.log_path, role=spec.role, rank=spec.dp_rank, name=spec.name)
    return ROLES.get(spec.role, run_rank)(spec, log)


if __name__ == "__main__":
    sys.exit(main())
