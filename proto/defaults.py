"""The defaults both sides of the wire share, written once: coordd's flags, the client's
config and the testing kit read them from here."""

#: Seconds a round may stay open after its first report (`--step-timeout`).
STEP_TIMEOUT = 30.0
#: ZMTP heartbeat interval and timeout, seconds (`--heartbeat-interval`, `--heartbeat-timeout`):
#: a peer that answers no PING for the timeout has its connection closed, and its rank is lost.
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 5.0
