"""The daemon's sans-IO core: decisions with time passed in, no sockets, no zmq, no CLI.

The group registry (`registry`: Hello -> group, the group limit, refusals, peer <-> group and
connection), the admission of peers that hold no rank (`admission`: counts, grace, cap,
pressure -> `Shut` actions), the handshake rate (`handshake`), the one token bucket, bounded
map and log throttle (`bounds`), every default once (`defaults`), option checks (`options`),
what a peer is shown as and the takeover record (`peers`), key=value events (`logs`)."""
