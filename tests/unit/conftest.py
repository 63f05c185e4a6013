"""Hypothesis settings for the unit suite: the same examples on every run, no example database,
no per-example deadline (a slow CI machine must not turn a pass into a flake).

`COORDD_HYPOTHESIS_PROFILE=fuzz pytest tests/unit` runs a long randomized search instead.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, deadline=None,
                          print_blob=True)
settings.register_profile("fuzz", max_examples=5000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("COORDD_HYPOTHESIS_PROFILE", "deterministic"))
