"""The direction of imports between coordd's layers, checked on the source (issues 10 and 20).

Layers, by module name: `coordd.proto` (the wire format and the coordinator's state machine),
`coordd.client` (what an engine rank runs), the daemon in four sub-packages: `coordd.core`
(sans-IO decisions and defaults), `coordd.ops` (observer, collector, /status, HTTP),
`coordd.io` (the ROUTER shell, gates, limits) and `coordd.cli` (the command), then
`coordd.testing` (the public kit for engines' tests), `coordd.vllm` (the vLLM plugin, loaded by
vLLM itself) and `coordd.tools` (bench, chaos, demo, load, device_check). The rules:

- proto imports nothing of ours but proto;
- client imports only proto;
- core imports only proto, and no zmq: its decisions are tested without sockets; it parses no
  options (no argparse), calls no OS (no os, sys, socket) and imports no logging: it takes
  values and returns decisions and the lines to log;
- ops imports core and proto (it reads the server through `coordd.ops.view`, never io);
- io imports ops, core and proto (it runs the state machine, never the client);
- cli imports the daemon's layers; nothing imports it but the tools and `python -m coordd`;
- testing imports proto and client (the daemon only as a subprocess, which is not an import);
- vllm imports proto and client (plus vllm and torch); nothing of ours imports it but tools;
- sglang (the SGLang plugin) imports proto, client and the vLLM plugin's pure helpers (plus
  sglang and torch); nothing of ours imports it but tools;
- tools may import everything.

Every `import` counts: at the top, inside functions, under TYPE_CHECKING; relative imports are
resolved. `coordd.cli` dispatching to a tool through `importlib.import_module("...")` is not an
import statement, so a subcommand's module loads only when it is chosen. Third-party imports are
held too: an engine rank installs pyzmq and msgspec (torch only for the device path), so proto,
client and testing may import nothing else beyond the standard library. No module of ours sits
directly in `coordd/` but the package itself and `__main__`, and no import goes in a circle.

Beside the static walk, one test imports the client in a fresh interpreter and checks that none of
the daemon's or the tools' dependencies were loaded.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import coordd

PACKAGE = "coordd"
PACKAGE_DIR = Path(coordd.__file__).resolve().parent

#: layer -> the layers it may import
ALLOWED: dict[str, frozenset[str]] = {
    "proto": frozenset({"proto"}),
    "client": frozenset({"proto", "client"}),
    "core": frozenset({"proto", "core"}),
    "ops": frozenset({"proto", "core", "ops"}),
    "io": frozenset({"proto", "core", "ops", "io"}),
    "cli": frozenset({"proto", "core", "ops", "io", "cli"}),
    "testing": frozenset({"proto", "client", "testing"}),
    "vllm": frozenset({"proto", "client", "vllm"}),
    "sglang": frozenset({"proto", "client", "vllm", "sglang"}),
    "tools": frozenset(
        {"proto", "client", "core", "ops", "io", "cli", "testing", "vllm", "sglang", "tools"}
    ),
}

#: The layers of the daemon (the sidecar process), bottom up.
DAEMON = ("core", "ops", "io", "cli")

#: layer -> the third-party top-level packages it may import (None: any)
THIRD_PARTY: dict[str, frozenset[str] | None] = {
    "proto": frozenset({"msgspec"}),
    "client": frozenset({"zmq", "msgspec", "torch"}),
    "testing": frozenset({"zmq", "msgspec"}),
    "vllm": frozenset({"zmq", "msgspec", "torch", "vllm"}),
    "sglang": frozenset({"zmq", "msgspec", "torch", "sglang"}),
    "core": frozenset({"msgspec"}),
    "ops": frozenset({"prometheus_client", "zmq"}),
    "io": None,
    "cli": None,
    "tools": None,
}

#: Loaded by an engine rank that imports the client, these would be a dependency it should not
#: need: rich (the demo), prometheus_client and uvloop (the daemon), torch (the device path only).
NOT_FOR_RANKS = (
    "rich",
    "prometheus_client",
    "uvloop",
    "torch",
    "coordd.tools",
    "coordd.io._server",
)


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written in module `source` at `path`:`line`."""

    source: str
    target: str
    path: str
    line: int
    #: under `if TYPE_CHECKING:`: read by the type checker only, never run
    typing_only: bool = False


def layer_of(module: str, package: str = PACKAGE) -> str | None:
    """The layer of one of our modules, or None for a module that is not ours."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    if module in (package, f"{package}.__main__"):
        return "cli"  # the package's own files: `python -m coordd` runs the command
    return "top"  # a module loose in coordd/: belongs in a layer (see test_no_loose_modules)


def modules_of(package_dir: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package (following the client/proto links): dotted name -> file."""
    out: dict[str, Path] = {}
    for folder, dirs, files in os.walk(package_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = Path(folder).relative_to(package_dir).parts
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = () if name == "__init__.py" else (name[:-3],)
            out[".".join((package, *rel, *stem))] = Path(folder) / name
    return out


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in the file, anywhere in it; `from a import b` names `a.b` if that is a
    module, else `a`; relative imports are resolved against the module's package."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    out: list[Import] = []
    for node in ast.walk(tree):
        hint = id(node) in typing_only
        if isinstance(node, ast.Import):
            out += [
                Import(module, alias.name, str(path), node.lineno, hint) for alias in node.names
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if candidate in known else base
                out.append(Import(module, target, str(path), node.lineno, hint))
    return out


def violations(package_dir: Path, package: str = PACKAGE) -> list[str]:
    """Every wrong arrow under `package_dir`, as 'path:line: source (layer) -> target (layer)'."""
    modules = modules_of(package_dir, package)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found: list[str] = []
    for module, path in modules.items():
        source = layer_of(module, package)
        assert source is not None
        if source == "top":
            found.append(f"{path}: {module} sits loose in {package}/: it belongs in a layer")
            continue
        for imp in dict.fromkeys(imports_of(module, path, set(modules))):
            target = layer_of(imp.target, package)
            where = f"{imp.path}:{imp.line}: {module} ({source}) -> {imp.target}"
            if target is not None:
                if target not in ALLOWED[source]:
                    allowed = ", ".join(sorted(ALLOWED[source]))
                    found.append(f"{where} ({target}): {source} may import only {allowed}")
                continue
            top = imp.target.split(".")[0]
            third_party = THIRD_PARTY[source]
            if third_party is not None and top not in stdlib and top not in third_party:
                allowed = ", ".join(sorted(third_party))
                found.append(f"{where}: {source} may use only {allowed} beyond the stdlib")
    return found


# -- the rules on coordd itself -------------------------------------------------------------


def test_every_import_points_the_allowed_way() -> None:
    wrong = violations(PACKAGE_DIR)
    assert not wrong, "wrong import arrows:\n" + "\n".join(wrong)


def cycles(
    package_dir: Path, package: str = PACKAGE, *, typing_too: bool = False
) -> list[list[str]]:
    """Every import circle among our modules (each found once, as the modules in its order);
    imports inside functions count: a lazy import that closes a circle hides it, not breaks it.
    With `typing_too`, so do imports under TYPE_CHECKING (two modules that need each other's
    types are one job, or one of them names what it reads as a Protocol). A package importing
    its own submodules (`from . import x` in `__init__`) never counts."""
    modules = modules_of(package_dir, package)
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for imp in imports_of(module, path, known):
            own_submodule = path.name == "__init__.py" and imp.target.startswith(module + ".")
            ours = imp.target in known and imp.target != module
            if ours and not own_submodule and (typing_too or not imp.typing_only):
                graph[module].add(imp.target)
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = stack[stack.index(nxt) :]
                if frozenset(circle) not in seen:
                    seen.add(frozenset(circle))
                    found.append(circle)
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_import_circle() -> None:
    found = cycles(PACKAGE_DIR)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_type_only_circle() -> None:
    """Not even for types: the guard and the server, proto's errors and messages, the chaos
    run and its scenarios each name what they read of the other as a Protocol or a module of
    its own (issue 31)."""
    found = cycles(PACKAGE_DIR, typing_too=True)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_lazy_circle(tmp_path: Path) -> None:
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/io/__init__.py": "from . import server\n",
            "coordd/io/server.py": "from coordd.ops import status\n",
            "coordd/ops/__init__.py": "",
            "coordd/ops/status.py": "def f():\n    from coordd.io.server import X\n",
            "coordd/ops/view.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from coordd.ops.observer import O\n",
            "coordd/ops/observer.py": "from coordd.ops.view import V\n",
        },
    )
    assert cycles(package_dir) == [["coordd.io.server", "coordd.ops.status"]]
    assert cycles(package_dir, typing_too=True) == [
        ["coordd.io.server", "coordd.ops.status"],
        ["coordd.ops.observer", "coordd.ops.view"],
    ]


def test_the_daemon_layers_point_one_way(tmp_path: Path) -> None:
    """The core knows no zmq and no other layer; ops reads no io; nothing imports the CLI but
    the tools; a module loose in coordd/ is refused."""
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/server.py": "",
            "coordd/core/__init__.py": "",
            "coordd/core/registry.py": "import zmq\nfrom coordd.ops import status\n",
            "coordd/ops/__init__.py": "",
            "coordd/ops/status.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from coordd.io.server import S\n",
            "coordd/io/__init__.py": "",
            "coordd/io/server.py": "from coordd.cli import X\nfrom coordd.core import registry\n",
            "coordd/cli/__init__.py": "from coordd.io import server\n",
            "coordd/tools/__init__.py": "from coordd.cli import main\n",
        },
    )
    wrong = violations(package_dir)
    assert len(wrong) == 5, wrong
    assert any("coordd.server sits loose" in w for w in wrong)
    assert any("coordd.core.registry (core) -> zmq: core may use only msgspec" in w for w in wrong)
    assert any("coordd.core.registry (core) -> coordd.ops.status (ops)" in w for w in wrong)
    assert any("coordd.ops.status (ops) -> coordd.io.server (io)" in w for w in wrong)
    assert any("coordd.io.server (io) -> coordd.cli (cli)" in w for w in wrong)


#: What the core may not import: it parses no options, reaches no OS and no process state.
CORE_NEVER_IMPORTS = frozenset(
    {"argparse", "os", "sys", "socket", "subprocess", "signal", "logging"}
)
#: ... and never decides where log lines go (it returns `LogEvent`s or logs to a given logger).
CORE_NEVER_CALLS = ("StreamHandler", "FileHandler", "addHandler", "basicConfig", "setLevel")


def core_violations(package_dir: Path, package: str = PACKAGE) -> list[str]:
    """Where a core module parses options, reaches the OS or sets up log output."""
    modules = modules_of(package_dir, package)
    found: list[str] = []
    for module, path in modules.items():
        if layer_of(module, package) != "core":
            continue
        for imp in imports_of(module, path, set(modules)):
            if imp.target.split(".")[0] in CORE_NEVER_IMPORTS:
                found.append(f"{imp.path}:{imp.line}: {module} imports {imp.target}")
        text = path.read_text()
        found += [f"{path}: {module} calls {name}" for name in CORE_NEVER_CALLS if name in text]
    return found


def test_the_core_only_decides() -> None:
    """The shell (io, cli) parses the options, calls the OS and sets up logging; the core takes
    values and returns decisions (issue 31)."""
    wrong = core_violations(PACKAGE_DIR)
    assert not wrong, "\n".join(wrong)


def test_the_core_check_can_fail(tmp_path: Path) -> None:
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/core/__init__.py": "",
            "coordd/core/options.py": "import argparse\n",
            "coordd/core/logs.py": "import logging\nlogging.getLogger().addHandler(None)\n",
        },
    )
    wrong = core_violations(package_dir)
    assert len(wrong) == 3, wrong
    assert any("coordd.core.options imports argparse" in w for w in wrong)
    assert any("coordd.core.logs imports logging" in w for w in wrong)
    assert any("coordd.core.logs calls addHandler" in w for w in wrong)


def test_the_walk_sees_every_layer() -> None:
    """A walk that found no modules (a broken link, a moved folder) would pass vacuously."""
    layers = {layer_of(m) for m in modules_of(PACKAGE_DIR)}
    assert layers == set(ALLOWED)
    assert set(DAEMON) <= layers
    assert "coordd.client.sync" in modules_of(PACKAGE_DIR)


def test_an_engine_rank_loads_only_pyzmq_and_msgspec() -> None:
    """Importing the client, the wire format and the testing kit loads none of the daemon's,
    the demo's or the device path's dependencies."""
    code = (
        "import sys, coordd.client, coordd.proto, coordd.client.dp_coordination, coordd.testing\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_FOR_RANKS!r}"
        f" or any(m.startswith(p + '.') or m == p for p in {NOT_FOR_RANKS!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_daemon_loads_no_tool_until_one_is_chosen() -> None:
    code = (
        "import sys\n"
        "from coordd.cli import parse\n"
        "parse(['--dp', '2'])\n"
        "assert not [m for m in sys.modules if m.startswith(('coordd.tools', 'coordd.testing',"
        " 'rich'))], sorted(sys.modules)\n"
        "parse(['bench', '--dp', '2'])\n"
        "assert 'coordd.tools.bench' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


# -- the walker can fail ----------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


def test_the_walker_reports_a_wrong_arrow_with_module_line_and_layers(tmp_path: Path) -> None:
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/io/server.py": "from coordd.proto import wire\n",
            "coordd/proto/__init__.py": "",
            "coordd/proto/wire.py": "import msgspec\n\n\ndef f():\n    from ..client import rank\n",
            "coordd/client/__init__.py": "from . import rank\n",
            "coordd/client/rank.py": "import zmq\nfrom coordd.proto.wire import f\n",
            "coordd/testing/__init__.py": "import coordd.io.server\n",
            "coordd/tools/__init__.py": "from coordd.io import server\nimport rich\n",
        },
    )
    wrong = violations(package_dir)
    assert len(wrong) == 2, wrong
    proto, testing = sorted(wrong, key=lambda w: "testing" in w)
    assert proto.endswith(
        "wire.py:5: coordd.proto.wire (proto) -> coordd.client.rank (client): "
        "proto may import only proto"
    )
    assert "__init__.py:1: coordd.testing (testing) -> coordd.io.server (io)" in testing


def test_the_walker_holds_the_rank_side_to_pyzmq_and_msgspec(tmp_path: Path) -> None:
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/client/__init__.py": "import json\nimport zmq\n\n\ndef f():\n    import rich\n",
        },
    )
    assert violations(package_dir) == [
        f"{package_dir}/client/__init__.py:6: coordd.client (client) -> rich: "
        "client may use only msgspec, torch, zmq beyond the stdlib"
    ]


def test_only_the_tools_may_import_the_vllm_plugin(tmp_path: Path) -> None:
    """The plugin is loaded by vLLM (its entry point), never by the client, daemon or kit; and
    it may not reach into the daemon."""
    package_dir = _write(
        tmp_path,
        {
            "coordd/__init__.py": "",
            "coordd/io/server.py": "",
            "coordd/client/__init__.py": "from coordd.vllm import register\n",
            "coordd/vllm/__init__.py": "import vllm\nimport torch\nfrom coordd.io import server\n",
            "coordd/tools/__init__.py": "from coordd.vllm import register\n",
        },
    )
    wrong = violations(package_dir)
    assert len(wrong) == 2, wrong
    assert any("coordd.client (client) -> coordd.vllm (vllm)" in w for w in wrong)
    assert any("coordd.vllm (vllm) -> coordd.io.server (io)" in w for w in wrong)
