"""What operators read: each group's `Observer`, the Prometheus collector, the /status
document and readiness, and the HTTP endpoints; all through `view.ServerView`, never the
shell's sockets."""
