"""The plugin's switches and release checks inside real SGLang 0.5.23 (its entry point, what it
patches, what it refuses). Runs in the SGLang venv (`.ci/sglang-env`)."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is not installed here (run tests/sglang in .ci/sglang-env)"
)

from sglang.srt.managers.scheduler_components import dp_attn

from coordd.sglang import patches, register
from coordd.sglang.enable import PluginSettings

STOCK = (dp_attn.exchange_sync_rows, dp_attn.torch)


@pytest.fixture(autouse=True)
def _untouched() -> object:
    """Every test leaves dp_attn as SGLang made it (the conformance ranks fork from here)."""
    yield
    patches.uninstall()
    assert (dp_attn.exchange_sync_rows, dp_attn.torch) == STOCK


def test_sglangs_plugin_group_names_the_plugin() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("coordd") == "coordd.sglang:register"


def test_off_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COORDD_SGLANG", "COORDD_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    register()
    assert not patches.installed()
    monkeypatch.setenv("COORDD_SGLANG", "1")
    register()
    assert patches.installed()
    assert patches.wrapped(dp_attn.exchange_sync_rows) and patches.wrapped(dp_attn.torch)
    assert dp_attn.torch.tensor is STOCK[1].tensor  # every other name is torch's own
    patches.uninstall()
    assert (dp_attn.exchange_sync_rows, dp_attn.torch) == STOCK


def test_another_release_gets_one_warning_and_an_untouched_sglang(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with caplog.at_level(logging.WARNING, logger="sglang.coordd"):
        assert not patches.install(PluginSettings())
    assert [r.getMessage() for r in caplog.records] == [
        "coordd SGLang plugin NOT installed, SGLang keeps its own DP attention collectives: "
        "SGLang 0.5.24 is not a supported release (the plugin supports SGLang 0.5.23)"
    ]
    assert (dp_attn.exchange_sync_rows, dp_attn.torch) == STOCK


def test_moved_code_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def exchange_sync_rows(flat: object, row: object) -> None: ...

    monkeypatch.setattr(dp_attn, "exchange_sync_rows", exchange_sync_rows)
    with caplog.at_level(logging.WARNING, logger="sglang.coordd"):
        assert not patches.install(PluginSettings())
    assert "exchange_sync_rows(global_flat, local_row, group)" in caplog.text
    assert dp_attn.exchange_sync_rows is exchange_sync_rows
