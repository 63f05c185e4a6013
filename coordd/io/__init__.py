"""The daemon's I/O shell. Its one public name is `CoordServer`; the modules are private.

The uvloop + ROUTER server (`_server`: the drain and the monitor), what it sends (`_outbox`),
the registry's actions carried out (`_carry_out`), its socket set up and bound (`_router`), the
shell side of admission (`_guard`: shutdowns, the grace timer, the memory watch), the one
deadline timer (`_deadlines`), what those two may call on the server (`_hosts`), a group as the
shell holds it (`_group`), the shell's counts (`_stats`), routing ids (`_identity`), the ZAP
gates (`_gate`, `_curve`), the listener's path (`_listen`), what admission asks of the OS
(`_limits`) and the memory reader (`_memory`)."""

from coordd.io._server import CoordServer

__all__ = ["CoordServer"]
