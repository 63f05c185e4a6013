"""The settings a chaos run is made of, and what one worker process is told to do (as JSON)."""

from __future__ import annotations

import enum

import msgspec


class Fault(str, enum.Enum):
    """The fault kinds, one scenario each."""

    SKIPPED_SEQ = "skipped_seq"
    REPEATED_SEQ = "repeated_seq"
    WRONG_KIND = "wrong_kind"
    CONFLICTING_DUPLICATE = "conflicting_duplicate"
    DP_SIZE_MISMATCH = "dp_size_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    VERSION_MISMATCH = "version_mismatch"
    DUPLICATE_RANK = "duplicate_rank"
    RANK_KILLED = "rank_killed"
    RANK_PAUSED = "rank_paused"
    STRAGGLER = "straggler"
    COORDD_RESTART = "coordd_restart"
    GARBAGE_FRAMES = "garbage_frames"
    SPOOFED_RANK = "spoofed_rank"
    NETWORK_CUT = "network_cut"
    INVALID_VALUE = "invalid_value"
    CLIENT_MISUSE = "client_misuse"
    STRANGER_NOISE = "stranger_noise"
    TAKEOVER_ATTEMPT = "takeover_attempt"
    ID_CLAIMS = "id_claims"
    JUNK_GROUPS = "junk_groups"
    FORGED_ANSWERS = "forged_answers"
    ABANDONED_ROUND = "abandoned_round"
    RELAY_KILLED = "relay_killed"
    RELAY_PAUSED = "relay_paused"
    RELAY_CUT = "relay_cut"
    COORDD_LOST_FALLBACK = "coordd_lost_fallback"
    COORDD_BACK_FALLBACK = "coordd_back_fallback"
    COORDD_FLAPPING = "coordd_flapping"
    COORDD_PARTIAL_ANSWER = "coordd_partial_answer"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What a user points the harness at: timeouts and transport as their deployment has them."""

    transport: str = "ipc"
    step_timeout: float = 2.0
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.0
    min_dp: int = 2
    max_dp: int = 4
    #: Rounds each scenario runs (the fault lands somewhere in the first half).
    rounds: int = 30
    #: Scheduling slack added to the detection bound (step timeout + heartbeat timeout).
    grace: float = 1.0

    @property
    def detection_bound(self) -> float:
        return self.step_timeout + self.heartbeat_timeout + self.grace

    @property
    def wait_timeout(self) -> float:
        """How long a rank waits on its own before it calls the round a hang."""
        return self.step_timeout + self.heartbeat_timeout + self.heartbeat_interval + 2.0

    @property
    def budget(self) -> float:
        """Wall time one scenario may take before its processes are killed (and hangs counted)."""
        return 10.0 + 5 * (self.step_timeout + self.heartbeat_timeout) + self.rounds * 0.05


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one chaos process needs; the runner writes it as JSON for the worker to read."""

    #: rank | raw | joiner | impostor | garbage | stranger | taker | claimer | squatter | proxy
    role: str
    name: str
    address: str
    dp_size: int
    dp_rank: int
    seed: int
    end_seq: int
    log_path: str
    deadline: float  # time.monotonic() by which the worker stops on its own
    step_timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    wait_timeout: float
    fingerprint: str = "chaos"
    recover: bool = True
    fault: str = ""
    fault_seq: int = -1
    #: wrong_kind: the rogue reports round `fault_seq` first (the honest ranks hold back a
    #: moment), so its report opens coordd's round; else it reports last.
    rogue_first: bool = False
    straggle_seqs: list[int] = []
    #: Rounds this rank reports a moment late (another rank's misuse lands while they are open)
    hold_seqs: list[int] = []
    #: Run on past `end_seq` until the runner writes this file (the culprit outside the group
    #: is done), then up to the seq in it: the group is seen going on after the culprit.
    until_file: str = ""
    straggle_delay: float = 0.0
    #: joiner: the bad Hello field and value (dp_size, config_fingerprint, protocol_version)
    hello_field: str = ""
    hello_value: str = ""
    #: garbage: how many bad frames to send; stranger: how many messages in its fast burst
    frames: int = 0
    #: invalid_value: the report field set out of range in round `fault_seq`, and its value
    bad_field: str = ""
    bad_value: int = 0
    #: client_misuse: the rounds of a second wait(), of a start() while the round is open,
    #: and of a close() from another thread during wait() (the last, the one detected), and
    #: how long after its start() the close comes
    misuse_seqs: dict[str, int] = {}
    close_delay: float = 0.0
    #: abandoned_round: the round this rank starts early and then abandons before it waits
    #: (the vLLM plugin's path when a step raises between its early start and its sync)
    abandon_seq: int = -1
    #: takeover_attempt: the victim writes its connection's routing id into its log (the
    #: worst case: it leaked), and the taker reads it there
    leak_identity: bool = False
    victim_log: str = ""
    #: id_claims: names held (`\x00` + 4 random bytes), id-less handshakes in flight at once,
    #: and for how long (`coordd.tools.load.claims.attack`)
    claims: int = 0
    in_flight: int = 0
    claim_seconds: float = 0.0
    #: junk_groups: Hellos for groups coordd's --groups does not admit (each refused
    #: group_unexpected), and names its patterns admit: `fill_groups` take the --max-groups
    #: slots before the group starts (the last one, a raw member, floods later), and
    #: `over_groups` are asked for at the limit (refused group_limit), one before the group
    #: starts and one while it runs
    junk_names: list[str] = []
    fill_groups: list[str] = []
    over_groups: list[str] = []
    #: forged_answers (the proxy): where coordd really is (ranks get the proxy's address), the
    #: misfit made of the victim's (`dp_rank`) decision of round `fault_seq` (`forge`: the
    #: field it breaks), and the answer added unsolicited after `extra_rank`'s decision of
    #: that round (`extra`: "again" or "old_epoch"); the proxy ends once `stop_file` exists
    upstream: str = ""
    forge: str = ""
    extra: str = ""
    extra_rank: int = -1
    stop_file: str = ""
    #: Start only once the process logging to `trigger_log` has begun round `trigger_seq`
    #: (the process is already up then, so the fault lands while the group is running).
    trigger_log: str = ""
    trigger_seq: int = -1
    #: A startup barrier: begin (rounds, or a joiner's Hello) once the runner creates this file,
    #: so a process slow to start cannot make the group time out before the fault is injected.
    go_file: str = ""
