"""The `coordd` command: `coordd --dp 8` serves; subcommands run the demo and other tools.

Every option of the server can also come from an environment variable `COORDD_<OPTION>`
(`--step-timeout` <- `COORDD_STEP_TIMEOUT`); a flag on the command line wins.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from coordd.cli._checks import check_server_args, deployment_connections, fit_limits
from coordd.cli._parser import (
    SUBCOMMANDS,
    Subcommand,
    add_limit_options,
    add_server_options,
    apply_env,
    env_var,
    parse,
)
from coordd.cli._serve import serve, stopped

__all__ = [
    "SUBCOMMANDS",
    "Subcommand",
    "add_limit_options",
    "add_server_options",
    "apply_env",
    "check_server_args",
    "deployment_connections",
    "env_var",
    "fit_limits",
    "main",
    "parse",
    "serve",
    "stopped",
]


def main(argv: Sequence[str] | None = None) -> int:
    args, chosen = parse(sys.argv[1:] if argv is None else argv)
    if chosen is not None:
        return int(chosen.run(args))
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
