"""Run code on a module once something else imports it: the plugin patches vLLM's V1 runner,
and each patch point whose module is not loaded at install, when vLLM loads them, and never
imports them itself.

`vllm.v1.worker.gpu_model_runner` costs seconds of CPU to import, and in vLLM 0.33 its import
starts two background build processes (the `humming` kernels' package spawns them, each a
Python that imports torch). Only a process that runs the V1 runner needs it: a worker imports it
when it builds its runner, after vLLM has loaded the plugin; the front-end, the engine cores and
Model Runner V2's workers never import it. `when_imported` lets the plugin wait for it there.
The patch points' modules (`coordd.vllm.patches.POINT_MODULES`) are the same case on a smaller
scale: importing the engine core's and the runners' sync modules at install was most of the
install's CPU in every rank process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
import threading
import types
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from typing import Any


class _Hook(importlib.abc.MetaPathFinder):
    """On sys.meta_path until module `name` is found: its spec is the other finders' own, with a
    loader that calls `then(module)` after the module's code has run."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self._lock = threading.Lock()
        self._done = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name or self._done:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def fire(self, module: types.ModuleType) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self.cancel()
        self.then(module)

    def cancel(self) -> None:
        self._done = True
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the hook; the module keeps its own loader in its
    `__loader__` and `__spec__` (inspect and linecache read its source through them)."""

    def __init__(self, loader: Any, hook: _Hook) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.hook.fire(module)


def loaded(name: str) -> types.ModuleType | None:
    """Module `name` if it is imported (or being imported: then as `import` gives it, after
    another thread's import of it is done), else None; never starts its import."""
    if name not in sys.modules:
        return None
    return importlib.import_module(name)


def when_imported(name: str, then: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """Call `then(module)` once, with module `name`: now if it is imported already, else right
    after its code has run when something imports it (`then` runs inside that import: it must
    not raise). Returns `cancel()`, which drops the wait if it has not fired."""
    hook = _Hook(name, then)
    sys.meta_path.insert(0, hook)  # first, so an import that starts meanwhile finds it
    module = loaded(name)
    if module is not None:
        hook.fire(module)  # once, whichever of the two comes first
    return hook.cancel
