"""Every option's range, checked before anything starts (issue 11, C): `coordd serve`, the
demo, the chaos runner and the benchmark refuse out-of-range values with one line naming the
option (exit code 1), and the client's settings are checked when made."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordd import cli
from coordd.client._config import ClientConfig
from coordd.core._settings import ServerSettings
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
        (["--dp", "2", "--expect-groups", "dp-tp0-pp0,junk"],
         "--expect-groups names 'junk', which --groups (dp-tp0-pp0,enginecore,default,"
         "dp-tp*-pp*) does not admit"),
        (["--dp", "2", "--expect-groups", ","], "--expect-groups"),
        (["--dp", "2", "--metrics-port", "70000"], "--metrics-port must be 0..65535"),
        (["--dp", "2", "--max-handshake-rate", "0.5"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--max-handshake-rate", "-1"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--max-handshake-rate", "nan"], "--max-handshake-rate must be 0 (off) or"),
        (["--dp", "2", "--handshake-ipv4-prefix", "33"], "--handshake-ipv4-prefix must be 8..32"),
        (["--dp", "2", "--handshake-ipv4-prefix", "4"], "--handshake-ipv4-prefix must be 8..32"),
        (["--dp", "2", "--bind", "localhost:5555"], "has no scheme: write tcp://localhost:5555"),
        (["--dp", "2", "--bind", "tcp://127.0.0.1", "--insecure"], "has no port"),
        (["--dp", "2", "--bind", "tcp://::1:5555", "--insecure"], "goes in brackets"),
        (["--dp", "2", "--bind", "ipc:///tmp/" + "x" * 120], "longer than a UNIX socket"),
        (["--dp", "2", "--bind", "tcp://127.0.0.1:5555", "--curve-secret-key", "/k/c.key_secret",
          "--curve-client-keys", "9-3=/k/n.key"], "9-3=/k/n.key: a range of dp_ranks runs low"),
        (["--dp", "2", "--relay-root", "--relay-to", "ipc:///tmp/r.sock", "--relay-ranks", "0"],
         "--relay-root and --relay-to: a coordd is the root relays register with, or a relay"),
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


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("COORDD_DP", "eight", "COORDD_DP='eight': --dp takes a whole number"),
        ("COORDD_IPC_MODE", "777", "COORDD_IPC_MODE='777': --ipc-mode takes one of 600, 660"),
        ("COORDD_LOG_FORMAT", "xml", "COORDD_LOG_FORMAT='xml': --log-format takes one of text"),
        ("COORDD_LOG_LEVEL", "loud", "COORDD_LOG_LEVEL='loud': --log-level takes one of debug"),
        ("COORDD_ON_RANK_LOSS", "ignore", "--on-rank-loss takes one of fail, neutralize"),
        ("COORDD_STEP_TIMEOUT", "soon", "COORDD_STEP_TIMEOUT='soon': --step-timeout takes a "
         "number"),
        ("COORDD_INSECURE", "maybe", "COORDD_INSECURE='maybe': --insecure takes 1/0"),
        ("COORDD_METRICS_PORT", "http", "--metrics-port takes a whole number"),
        ("COORDD_HANDSHAKE_IPV4_PREFIX", "/24", "--handshake-ipv4-prefix takes a whole number"),
    ],
)
def test_a_bad_variable_is_one_line_naming_it_and_what_it_takes(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, says: str
) -> None:
    """Before: COORDD_IPC_MODE=777, COORDD_LOG_FORMAT=xml and COORDD_ON_RANK_LOSS=ignore gave
    tracebacks (KeyError, ValueError) (issue 21, item 13)."""
    monkeypatch.setenv(var, value)
    argv = [] if var == "COORDD_DP" else ["--dp", "2"]
    with pytest.raises(SystemExit) as caught:
        cli.parse(argv)
    assert str(caught.value.code) == f"coordd: {says}" or says in str(caught.value.code)
    assert "\n" not in str(caught.value.code)


def test_a_variable_out_of_range_is_named_beside_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDD_DP", "0")
    assert refusal([]).endswith("got 0 (from COORDD_DP)")
    args, _ = cli.parse(["--dp", "0"])  # the flag wins, and is named alone
    with pytest.raises(SystemExit) as caught:
        cli.check_server_args(args)
    assert "COORDD_DP" not in str(caught.value.code)


def test_the_environment_gives_values_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDD_DP", "8")
    monkeypatch.setenv("COORDD_STEP_TIMEOUT", "2.5")
    monkeypatch.setenv("COORDD_INSECURE", "yes")
    monkeypatch.setenv("COORDD_CURVE_CLIENT_KEYS", "a.key, b.key")
    args, _ = cli.parse(["--step-timeout", "4"])
    assert (args.dp, args.step_timeout, args.insecure) == (8, 4.0, True)
    assert args.curve_client_keys == ["a.key", "b.key"]
    assert args.from_env == {"--dp": "COORDD_DP", "--insecure": "COORDD_INSECURE",
                             "--curve-client-keys": "COORDD_CURVE_CLIENT_KEYS"}
    args, _ = cli.parse(["--dp", "2"])
    assert args.max_groups == 64 and args.log_level == "info" and args.bind is None


def test_relays_are_taken_only_by_a_root_the_flag_or_its_variable_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--relay-root` is off unless given (a flat coordd takes no relays); COORDD_RELAY_ROOT
    sets it as --insecure's variable does, and reaches the server's settings."""
    args, _ = cli.parse(["--dp", "2"])
    assert args.relay_root is False
    monkeypatch.setenv("COORDD_RELAY_ROOT", "1")
    args, _ = cli.parse(["--dp", "2"])
    assert args.relay_root is True and args.from_env == {"--relay-root": "COORDD_RELAY_ROOT"}
    monkeypatch.setenv("COORDD_RELAY_ROOT", "perhaps")
    with pytest.raises(SystemExit, match="COORDD_RELAY_ROOT='perhaps': --relay-root takes 1/0"):
        cli.parse(["--dp", "2"])


def test_a_bad_server_variable_does_not_break_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: COORDD_DP=eight broke `coordd status` (and the container's HEALTHCHECK)."""
    monkeypatch.setenv("COORDD_DP", "eight")
    monkeypatch.setenv("COORDD_IPC_MODE", "777")
    args, chosen = cli.parse(["status", "--probe", "livez"])
    assert chosen is not None and args.probe == "livez"
    monkeypatch.setenv("COORDD_METRICS_PORT", "abc")  # but its own variable is checked
    with pytest.raises(SystemExit, match="COORDD_METRICS_PORT='abc': it takes a port number"):
        cli.parse(["status"])


def test_serve_help_shows_every_default() -> None:
    """Before: --step-timeout, --heartbeat-* and --log-level (no help text) showed none."""
    parser = argparse.ArgumentParser()
    cli.add_server_options(parser)
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and ("default" in action.help or "required" in action.help), action


def test_the_stop_line_is_key_value(caplog: pytest.LogCaptureFixture) -> None:
    """Before: "rounds decided by group and kind {'default': {'forward': 2}}"."""
    import logging

    with caplog.at_level(logging.INFO, logger="coordd"):
        cli.stopped(logging.getLogger("coordd"), {"default": {"state": 1, "forward": 2}})
    assert [r.getMessage() for r in caplog.records] == [
        "coordd stopped rounds=3 groups=1",
        "rounds decided group=default rounds=3 forward=2 state=1",
    ]


def test_the_stop_line_of_a_group_without_rounds_says_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 30: a group that decided no round ended the log with a bare "rounds decided
    group=default"."""
    import logging

    with caplog.at_level(logging.INFO, logger="coordd"):
        cli.stopped(logging.getLogger("coordd"), {"default": {}, "other": {"forward": 0}})
    assert [r.getMessage() for r in caplog.records] == [
        "coordd stopped rounds=0 groups=2",
        "rounds decided group=default rounds=0",
        "rounds decided group=other rounds=0",
    ]


def test_coordd_serve_without_dp_is_one_line() -> None:
    """Issue 30: `coordd serve` without --dp printed 17 lines of usage before its error."""
    env = {k: v for k, v in os.environ.items() if k != "COORDD_DP"}
    for argv in (["serve"], [], ["--step-timeout", "5"]):
        done = subprocess.run([sys.executable, "-m", "coordd", *argv], capture_output=True,
                              text=True, timeout=60, env=env)
        assert done.returncode == 1, argv
        assert done.stdout == ""
        assert done.stderr.strip().splitlines() == [
            "coordd: --dp is required: the data-parallel size, vLLM's --data-parallel-size "
            "(coordd serve --dp 8, or COORDD_DP=8)"
        ], argv


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--dp", "two"], "coordd: --dp takes a whole number, got 'two'"),
        (["--dp", "2", "--step-timeout", "abc"],
         "coordd: --step-timeout takes a number, got 'abc'"),
        (["--dp", "2", "--ipc-mode", "644"], "coordd: --ipc-mode takes one of 600, 660, got '644'"),
        (["serve", "--dp", "2", "--on-rank-loss", "x"],
         "coordd: --on-rank-loss takes one of fail, neutralize, got 'x'"),
        (["--dp", "2", "--metrics-port", "abc"],
         "coordd: --metrics-port takes a whole number, got 'abc'"),
        (["--dp", "2", "--log-format", "yaml"],
         "coordd: --log-format takes one of text, json, got 'yaml'"),
        (["--dp", "2", "--bogus"],
         "coordd: unrecognized arguments: --bogus (`coordd serve --help` lists the options)"),
        (["--dp"], "coordd: --dp: expected one argument (`coordd serve --help` lists the options)"),
        (["status", "--timeout", "x"], "coordd status: --timeout takes a number, got 'x'"),
        (["status", "--probe", "ready"],
         "coordd status: --probe takes one of livez, readyz, got 'ready'"),
        (["status", "--bogus"], "coordd status: unrecognized arguments: --bogus "
         "(`coordd status --help` lists the options)"),
    ],
)
def test_a_bad_argument_is_one_line_naming_the_option_exit_1(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39, item 2: type and choice errors printed argparse's usage (20 lines), exit 2,
    where the README promises one line naming the option, exit code 1."""
    with pytest.raises(SystemExit) as caught:
        cli.parse(argv)
    assert caught.value.code == 1
    assert capsys.readouterr().err.splitlines() == [says]


def test_coordd_version_and_a_bad_type_as_a_user_runs_them() -> None:
    """Issue 39, item 8: `coordd --version` was `unrecognized arguments`, exit 2."""
    from coordd.ops.observer import version
    from coordd.proto.messages import PROTOCOL_VERSION

    shown = subprocess.run([sys.executable, "-m", "coordd", "--version"], capture_output=True,
                           text=True, timeout=60)
    assert (shown.returncode, shown.stdout) == (0, f"coordd {version()} (protocol "
                                                   f"{PROTOCOL_VERSION})\n")
    bad = subprocess.run([sys.executable, "-m", "coordd", "--dp", "two"], capture_output=True,
                         text=True, timeout=60)
    assert (bad.returncode, bad.stdout, bad.stderr) == (
        1, "", "coordd: --dp takes a whole number, got 'two'\n")


def test_good_options_pass() -> None:
    args, _ = cli.parse(["--dp", str(MAX_DP_SIZE), "--step-timeout", "0.5",
                         "--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.2",
                         "--bind", "tcp://[::1]:*", "--insecure"])
    assert cli.check_server_args(args) is False


def test_a_relay_may_run_under_a_neutralize_root() -> None:
    """A relay takes the mode from its root's Welcome: its own setting is no refusal."""
    args, _ = cli.parse(["--dp", "2", "--relay-to", "ipc:///tmp/r.sock", "--relay-ranks", "0",
                         "--on-rank-loss", "neutralize"])
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
        ServerSettings("ipc:///nonexistent-never-made/x.sock", dp_size=MAX_DP_SIZE + 1)


@pytest.mark.parametrize("field", ["wait_timeout", "heartbeat_interval", "heartbeat_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1e12])
def test_client_times_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"ClientConfig.{field} must be"):
        ClientConfig(dp_rank=0, dp_size=2, **{field: value})  # type: ignore[arg-type]


def test_coordd_status_asks_the_address_given_else_the_env_else_the_default_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 30: `coordd status` asked only http://127.0.0.1:9180; now --address (ipc or
    http), then $COORDD_STATUS_URL, then $COORDD_METRICS_PORT, then the default address's
    status socket, and nothing else (issue 36: no 9180 fallback another process may hold)."""
    from coordd.cli.status import targets

    for var in ("COORDD_STATUS_URL", "COORDD_METRICS_PORT", "COORDD_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    default = f"unix:{tmp_path}/coordd/coordd.sock.http"
    assert targets(None) == [default]
    monkeypatch.setenv("COORDD_ADDRESS", "ipc:///run/coordd/coordd.sock")
    assert targets(None) == ["unix:/run/coordd/coordd.sock.http"]
    monkeypatch.setenv("COORDD_ADDRESS", "tcp://127.0.0.1:5555")
    assert targets(None) == []
    monkeypatch.setenv("COORDD_ADDRESS", "ipc:///run/coordd/coordd.sock")
    monkeypatch.setenv("COORDD_METRICS_PORT", "9999")
    assert targets(None) == ["http://127.0.0.1:9999"]
    monkeypatch.setenv("COORDD_STATUS_URL", "http://h:1")
    assert targets(None) == ["http://h:1"]
    assert targets("ipc:///x/c.sock") == ["unix:/x/c.sock.http"]
    assert targets("http://10.0.0.1:9180") == ["http://10.0.0.1:9180"]
    with pytest.raises(SystemExit, match="--metrics-port"):
        targets("tcp://10.0.0.1:5555")


def test_the_connection_cap_leaves_room_for_every_rank_of_every_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 28, defect 1: by default `coordd serve` sizes --max-connections from --dp and the
    groups it may serve (at least 1024); a cap set (or fitted to NOFILE) below that is said at
    start-up, naming the flags."""
    import logging

    log = logging.getLogger("coordd.test")
    args, _ = cli.parse(["--dp", "16"])
    assert args.max_connections == 0  # auto
    assert cli.fit_limits(args, log).zmq == 16 * (64 + 3) + 64  # dp-tp0-pp0, enginecore, default
    args, _ = cli.parse(["--dp", "2"])
    assert cli.fit_limits(args, log).zmq == 1024  # at least the old default
    args, _ = cli.parse(["--dp", "16", "--expect-groups", "dp-tp0-pp0,enginecore,dp-tp1-pp0"])
    assert cli.fit_limits(args, log).zmq == 16 * (64 + 4) + 64  # dp-tp1-pp0 named too
    caplog.set_level(logging.WARNING, logger="coordd.test")
    args, _ = cli.parse(["--dp", "16", "--max-connections", "1024"])
    assert cli.fit_limits(args, log).zmq == 1024
    (line,) = [r.getMessage() for r in caplog.records if "no room" in r.getMessage()]
    assert "--dp 16 x (--max-groups 64 + 3 named groups) + 64 for newcomers = 1136" in line
