"""The daemon's sans-IO core: decisions with time passed in, no sockets, no zmq, no CLI.

Every module is private. The group registry (`_registry`: Hello -> group, the group limit,
refusals, peer <-> group and connection; group names and `--groups` rules in `_group_names`),
the admission of peers that hold no rank (`_admission`: counts, grace, cap, pressure -> `Shut`
actions), the handshake rate (`_handshake`), the one token bucket, bounded map and log throttle
(`_bounds`), every default of the daemon once (`_daemon_defaults`), the server's settings
(`_settings`), option checks (`_options`), what a peer is shown as and the takeover record
(`_peers`), key=value events (`_logs`)."""
