"""coordd's tools: the benchmark, the chaos runner, the demo and the device-path check.

Tools may import every layer; nothing in the daemon, the client or proto imports them.
"""
