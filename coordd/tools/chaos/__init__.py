"""The chaos suite: a real coordd and real rank processes, one injected fault per scenario
(rank mismatches, bad joins, killed/paused/straggling ranks, a coordd restart, garbage frames,
spoofing, a network cut, out-of-range values, client misuse, strangers forging reports, takeover
attempts with a leaked routing id), every sync of every rank logged, and a checker that holds
the whole history to the rules. `coordd chaos` runs it and prints the table.

suite.py runs scenarios (scenario_run.py: one run's processes and building blocks);
scenarios/ defines one per fault kind; worker.py is the process the runner starts, playing a
role from roles/ (ranks, the raw rank, the rogue, the stranger, the taker, ...); summary.py
tabulates. What the processes log and the checker that judges it live in `coordd.testing`
(history.py, checker.py), so an engine's own tests can use them.
"""
