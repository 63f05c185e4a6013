"""`python -m coordd.tools.chaos.serve LOG serve ARGS...`: the real `coordd serve`, logging to LOG.

The chaos checker reads coordd's own log (how many bad frames it dropped, which rounds failed),
so the harness starts coordd through this two-line shim instead of letting the log go to the
terminal; the server itself is the unchanged `coordd.cli.main`.
"""

from __future__ import annotations

import os
import sys

from coordd.cli import main

if __name__ == "__main__":
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    sys.exit(main(sys.argv[2:]))
