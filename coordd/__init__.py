"""coordd: the coordination sidecar (daemon, CLI, tools) around the `proto` state machine."""

__version__ = "0.1.0"
