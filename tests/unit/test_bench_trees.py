"""The two-tree comparison's arithmetic: its order, its quantiles, its per-pair ratios."""

from __future__ import annotations

import pytest

from coordd.tools.bench import trees


def _rows(ipc_p50: float, hub_p50: float, rank_cpu: float, dp: int = 2) -> list[dict]:
    threads = {"ranks main": rank_cpu * dp, "server main": 40.0 * dp}
    return [
        {"dp": dp, "method": "coordd-ipc", "p50_us": ipc_p50, "p99_us": 3 * ipc_p50,
         "cpu_us_per_round_by_thread": threads},
        {"dp": dp, "method": "zmq-hub", "p50_us": hub_p50, "p99_us": 2 * hub_p50,
         "cpu_us_per_round_by_thread": {"ranks main": 10.0 * dp, "server main": 20.0 * dp}},
    ]  # fmt: skip


def test_pairs_alternate_which_side_goes_first() -> None:
    assert trees.order(3) == ["before", "after", "after", "before", "before", "after"]


def test_quantiles_interpolate_between_pairs() -> None:
    assert trees.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert trees.quantile([1.0, 2.0], 0.1) == pytest.approx(1.1)
    assert trees.quantile([7.0], 0.9) == 7.0


def test_each_pair_is_compared_with_its_own_partner() -> None:
    runs = {
        "before": [_rows(200, 100, 40), _rows(300, 100, 60)],
        "after": [_rows(100, 100, 20), _rows(300, 150, 30)],
    }
    table = {r["metric"]: r for r in trees.compare(runs, [2])}
    p50 = table["coordd-ipc p50 us"]
    assert p50["before_runs"] == [200, 300] and p50["after_runs"] == [100, 300]
    assert p50["ratio_p50"] == pytest.approx(0.75)  # pairs 0.5 and 1.0
    assert table["coordd-ipc / hub p50"]["after_runs"] == [1.0, 2.0]
    assert table["rank main CPU us"]["before"] == pytest.approx(50.0)  # per rank: / dp
    assert table["rank main CPU / hub rank's"]["after_runs"] == [2.0, 3.0]
    assert table["coordd main CPU / hub's"]["ratio_p50"] == pytest.approx(1.0)


def test_a_figure_no_run_measured_is_left_out() -> None:
    rows = [r for r in _rows(200, 100, 40) if r["method"] == "coordd-ipc"]
    table = trees.compare({"before": [rows], "after": [rows]}, [2])
    assert "coordd-ipc / hub p50" not in {r["metric"] for r in table}
    assert "coordd-ipc p50 us" in {r["metric"] for r in table}


def test_a_folder_that_is_no_coordd_tree_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        trees.main(["--before", str(tmp_path), "--after", str(tmp_path), "--", "--dp", "2"])
