"""The daemon's sans-IO core: decisions with time passed in, no sockets, no zmq, no CLI.

Every default once (`defaults`), option checks (`options`), what a peer is shown as and the
takeover record (`peers`), log throttling and key=value events (`logs`)."""
