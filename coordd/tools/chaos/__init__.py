"""The chaos suite: a real coordd and real rank processes, one injected fault per scenario
(rank mismatches, bad joins, killed/paused/straggling ranks, a coordd restart, garbage frames,
spoofing, a network cut), every sync of every rank logged, and a checker that holds the whole
history to the rules. `coordd chaos` runs it and prints the table.

runner.py runs scenarios; scenarios.py defines one per fault kind; worker.py, rawrank.py and
rogue.py are the processes; history.py is what they log; checker.py judges (its rules in
rounds.py and detection.py, its types in verdict.py); report.py tabulates.
"""
