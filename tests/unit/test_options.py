"""Every option's range, checked before anything starts (issue 11, C): `coordd serve`, the
demo, the chaos runner and the benchmark refuse out-of-range values with one line naming the
option (exit code 1, or argparse's 2), and the client's settings are checked when made."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from coordd import cli
from coordd.client.config import ClientConfig
from coordd.io.server import CoordServer
from coordd.proto.messages import MAX_DP_SIZE


def refusal(argv: list[str]) -> str:
    args, chosen = cli.parse(argv)
    with pytest.raises(SystemExit) as caught:
        if chosen is None:
            cli.check_server_args(args)
        elif argv[0] == "demo":
            from coordd.tools.demo import check_args

            check_args(args)
        else:
            from coordd.tools.chaos.cli import settings_from

            settings_from(args)
    message = str(caught.value.code)
    assert "Traceback" not in message and "\n" not in message
    return message


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--dp", "5000"], f"--dp must be 1..{MAX_DP_SIZE}"),
        (["--dp", "0"], f"--dp must be 1..{MAX_DP_SIZE}"),
        (["--dp", "2", "--step-timeout", "-1"], "--step-timeout must be in 0.001.."),
        (["--dp", "2", "--step-timeout", "0"], "--step-timeout must be in"),
        (["--dp", "2", "--step-timeout", "nan"], "--step-timeout must be a number of seconds"),
        (["--dp", "2", "--step-timeout", "inf"], "--step-timeout must be a number of seconds"),
        (["--dp", "2", "--heartbeat-interval", "0", "--heartbeat-timeout", "0"],
         "--heartbeat-interval must be in 0.001.."),
        (["--dp", "2", "--heartbeat-timeout", "0"], "--heartbeat-timeout must be in"),
        (["--dp", "2", "--heartbeat-interval", "5", "--heartbeat-timeout", "1"],
         "--heartbeat-timeout (1s) must be at least --heartbeat-interval (5s)"),
        (["--dp", "2", "--heartbeat-interval", "1e9"], "--heartbeat-interval must be in"),
        (["--dp", "2", "--max-groups", "0"], "--max-groups must be"),
        (["--dp", "2", "--expect-groups", "100"],
         "--expect-groups must be in 0..--max-groups (64)"),
        (["--dp", "2", "--metrics-port", "70000"], "--metrics-port must be 0..65535"),
        (["--dp", "2", "--max-handshake-rate", "0.5"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--max-handshake-rate", "-1"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--max-handshake-rate", "nan"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--bind", "localhost:5555"], "has no scheme: write tcp://localhost:5555"),
        (["--dp", "2", "--bind", "tcp://127.0.0.1", "--insecure"], "has no port"),
        (["--dp", "2", "--bind", "tcp://::1:5555", "--insecure"], "goes in brackets"),
        (["--dp", "2", "--bind", "ipc:///tmp/" + "x" * 120], "longer than a UNIX socket"),
        (["demo", "--dp", "1"], "--dp must be >= 2"),
        (["demo", "--bind", "tcp://127.0.0.1:*"], "needs CURVE"),
        (["demo", "--bind", "127.0.0.1:5555"], "has no scheme"),
        (["demo", "--seconds", "-2"], "--seconds must be in"),
        (["demo", "--rounds", "0"], "--rounds must be"),
        (["chaos", "--step-timeout", "-1"], "--step-timeout must be in"),
        (["chaos", "--heartbeat-interval", "0", "--heartbeat-timeout", "0"],
         "--heartbeat-interval must be in"),
        (["chaos", "--seeds", "0"], "--seeds must be"),
        (["chaos", "--parallel", "0"], "--parallel must be"),
        (["chaos", "--max-dp", "5000"], "--max-dp must be 2..4096"),
    ],
)
def test_an_out_of_range_option_is_one_line_naming_it(argv: list[str], says: str) -> None:
    assert says in refusal(argv)


def test_the_environment_is_checked_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDD_STEP_TIMEOUT", "-3")
    assert "--step-timeout must be in" in refusal(["--dp", "2"])


def test_good_options_pass() -> None:
    args, _ = cli.parse(["--dp", str(MAX_DP_SIZE), "--step-timeout", "0.5",
                         "--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.2",
                         "--bind", "tcp://[::1]:*", "--insecure"])
    assert cli.check_server_args(args) is False


def test_coordd_serve_exits_1_with_one_line() -> None:
    """The whole command, as a user runs it: exit code 1, one line, no traceback."""
    done = subprocess.run([sys.executable, "-m", "coordd", "--dp", "5000"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"coordd: --dp must be 1..{MAX_DP_SIZE} (the most ranks coordd's messages carry), got 5000"
    )


def test_bench_refuses_dp_0() -> None:
    """`coordd bench --dp 0` ran nothing and exited 0."""
    from coordd.tools.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for bad in ("0", "", "2,0", "5000", "x"):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(["--dp", bad])
        assert caught.value.code == 2
    assert parser.parse_args(["--dp", "2,4"]).dp == [2, 4]


def test_the_server_itself_refuses_a_dp_its_clients_cannot_decode() -> None:
    with pytest.raises(ValueError, match=f"1..{MAX_DP_SIZE}"):
        CoordServer("ipc:///nonexistent-never-made/x.sock", dp_size=MAX_DP_SIZE + 1)


@pytest.mark.parametrize("field", ["wait_timeout", "heartbeat_interval", "heartbeat_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1e12])
def test_client_times_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"ClientConfig.{field} must be"):
        ClientConfig(dp_rank=0, dp_size=2, **{field: value})  # type: ignore[arg-type]
