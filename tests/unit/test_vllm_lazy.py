"""`coordd.vllm.lazy.when_imported`: code run on a module when something else imports it, never
an import of its own. Pure: a throwaway package on sys.path, no vLLM."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordd.vllm import lazy

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package `lazypkg<n>` with a module `runner` that counts its own executions."""
    name = f"lazypkg{len(list(tmp_path.parent.iterdir()))}_{tmp_path.name}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "runner.py").write_text(
        "import builtins\n"
        "builtins.lazy_runs = getattr(builtins, 'lazy_runs', 0) + 1\n"
        "class Runner:\n"
        "    def step(self):\n"
        "        return 'vllm'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    assert sys.meta_path == before  # every wait fired or was cancelled


def test_nothing_is_imported_until_something_else_imports_it(package: str) -> None:
    seen: list[types.ModuleType] = []
    lazy.when_imported(f"{package}.runner", seen.append)
    importlib.import_module(package)
    assert f"{package}.runner" not in sys.modules and seen == []
    module = importlib.import_module(f"{package}.runner")
    assert seen == [module]
    assert module.Runner().step() == "vllm"  # its code ran, before the callback
    importlib.reload(module)
    assert seen == [module]  # once


def test_the_module_keeps_its_own_loader(package: str) -> None:
    """inspect and linecache read a module's source through its loader."""
    import inspect

    loaders: list[object] = []
    lazy.when_imported(f"{package}.runner", lambda m: loaders.append(m.__loader__))
    module = importlib.import_module(f"{package}.runner")
    assert module.__loader__ is module.__spec__.loader is loaders[0]
    assert isinstance(module.__loader__, importlib.machinery.SourceFileLoader)
    assert "return 'vllm'" in inspect.getsource(module.Runner.step)


def test_a_module_imported_already_is_handed_over_at_once(package: str) -> None:
    module = importlib.import_module(f"{package}.runner")
    seen: list[types.ModuleType] = []
    cancel = lazy.when_imported(f"{package}.runner", seen.append)
    assert seen == [module]
    cancel()


def test_cancel_drops_the_wait(package: str) -> None:
    seen: list[types.ModuleType] = []
    cancel = lazy.when_imported(f"{package}.runner", seen.append)
    cancel()
    importlib.import_module(f"{package}.runner")
    assert seen == []


def test_loaded_never_starts_an_import(package: str) -> None:
    """The install asks which patch points' modules are loaded: asking imports nothing."""
    name = f"{package}.runner"
    assert lazy.loaded(name) is None and name not in sys.modules
    module = importlib.import_module(name)
    assert lazy.loaded(name) is module


def test_a_wait_on_a_module_already_imported_fires_at_once_and_leaves_no_hook(
    package: str,
) -> None:
    module = importlib.import_module(f"{package}.runner")
    seen: list[types.ModuleType] = []
    cancel = lazy.when_imported(f"{package}.runner", seen.append)
    assert seen == [module]
    cancel()  # a no-op now
    assert seen == [module]
