""".ci/run runs every stage and fails at the end: a red stage does not hide the others.

Before: `set -e` stopped at the first failure (a chaos flake in the main suite skipped the vLLM
suite, ruff and mypy). Here the script runs in a copy of the repository with stub tools on
PATH: the main suite fails, the rest pass, and every stage still runs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_stage_runs_and_the_run_fails_at_the_end(tmp_path: Path) -> None:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    ran = tmp_path / "ran"
    # python3 -m venv makes an activate script that keeps the stubs first on PATH
    _stub(bin_ / "python3", f'mkdir -p .venv/bin; echo "export PATH={bin_}:$PATH" '
          "> .venv/bin/activate")
    _stub(bin_ / "python", "exit 0")
    _stub(bin_ / "pip", "exit 0")
    _stub(bin_ / "pytest", f'echo pytest >> {ran}; exit 1')
    _stub(bin_ / "ruff", f'echo "ruff $1" >> {ran}')
    _stub(bin_ / "mypy", f'echo mypy >> {ran}')
    _stub(tmp_path / ".ci" / "vllm-env", f'echo {bin_ / "vllm-python"}')
    _stub(bin_ / "vllm-python", f'echo vllm >> {ran}')
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ran.read_text().split("\n")[:-1] == [
        "pytest", "vllm", "ruff check", "ruff format", "mypy"
    ]
    summary = done.stdout[done.stdout.index(".ci/run summary:"):].splitlines()
    verdicts = {line.split()[0]: line for line in summary[1:-1]}
    assert "FAILED (exit 1)" in verdicts["main"] and "passed" in verdicts["vLLM"]
    assert "passed" in verdicts["mypy"] and "passed" in verdicts["install"]
    assert summary[-1] == ".ci/run: FAILED"
