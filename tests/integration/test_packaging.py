"""The installed shape: one top-level import name, `coordd`, that lives beside proto-plus.

vLLM deployments install proto-plus (a top-level `proto`) through google-api-core; coordd must
neither shadow it nor be shadowed by it, so the wheel holds `coordd` and nothing else.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: pip's own words when it cannot reach an index (the only reason the proto-plus test skips).
UNREACHABLE = (
    "Could not find a version",
    "No matching distribution",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Max retries exceeded",
)


def _containerfile_build_context(into: Path) -> Path:
    """What deploy/Containerfile's build stage COPYs, copied the way COPY does (links kept)."""
    text = (ROOT / "deploy" / "Containerfile").read_text()
    build_stage = text.split("\nFROM ")[1]
    for line in build_stage.splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--") for w in words):
            continue
        for source in words[1:-1]:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, into / source, symlinks=True)
            else:
                shutil.copy2(src, into / source)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel as deploy/Containerfile builds it: `pip wheel .` in the COPYed context."""
    context = _containerfile_build_context(tmp_path_factory.mktemp("context"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(context),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=240,
    )
    (built,) = out.glob("coordd-*.whl")
    return built


@pytest.mark.timeout(300)
def test_the_wheel_installs_one_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        infos = {info.filename: info for info in zf.infolist()}
    assert {name.split("/")[0] for name in infos if ".dist-info/" not in name} == {"coordd"}
    for module in ("coordd/client/sync.py", "coordd/proto/messages.py", "coordd/io/_server.py"):
        assert module in infos, f"{module} is missing from the wheel"
    links = [name for name, info in infos.items() if (info.external_attr >> 28) == 0o12]
    assert not links, f"the wheel holds links instead of files: {links}"


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *args],
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_coordd_and_proto_plus_live_side_by_side(wheel: Path, tmp_path: Path) -> None:
    """Installed in either order, both import, and removing coordd leaves proto-plus whole."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    done = _pip(python, "proto-plus")
    if done.returncode != 0 and any(word in done.stderr for word in UNREACHABLE):
        pytest.skip(
            f"the package registry is unreachable, proto-plus not installed: "
            f"{done.stderr.strip().splitlines()[-1]}"
        )
    assert done.returncode == 0, done.stderr
    done = _pip(python, str(wheel))
    assert done.returncode == 0, done.stderr

    both = (
        "import proto, coordd.proto, coordd.client; "
        "from coordd.proto import StepReport; "
        "assert hasattr(proto, 'Message'), proto.__file__; "
        "assert StepReport(num_tokens=1, num_tokens_padded=1).num_tokens == 1"
    )
    proto_plus = "import proto; assert hasattr(proto, 'Message'), proto.__file__"

    def imports(code: str) -> str:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        return done.stderr if done.returncode else ""

    assert imports(both) == "", "coordd installed after proto-plus"
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "coordd"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert imports(proto_plus) == "", "uninstalling coordd broke proto-plus"
    assert _pip(python, str(wheel)).returncode == 0
    assert _pip(python, "--force-reinstall", "--no-deps", "proto-plus").returncode == 0
    assert imports(both) == "", "proto-plus installed after coordd"
