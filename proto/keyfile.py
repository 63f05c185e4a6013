"""CURVE key files as `coordd keygen` (and ZeroMQ's own tools) write them: read and check.

Here, in proto, because both sides read them: a rank its key pair and coordd's public key,
coordd its secret key and the ranks' public keys. Plain text parsing, no sockets.
"""

from __future__ import annotations

#: ZeroMQ's z85 alphabet (RFC 32/Z85): 5 characters stand for 4 bytes.
Z85_ALPHABET = (
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_VALUE = {char: value for value, char in enumerate(Z85_ALPHABET)}
Z85_KEY_LENGTH = 40


class KeyFileError(ValueError):
    """A CURVE key file is missing, unreadable or malformed; `path` names it.

    Make a key pair with `coordd keygen --dir DIR NAME` and point the option or the
    environment variable named in the message at it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"CURVE key file {path}: {problem}")
        self.path = path
        self.problem = problem


def is_z85(text: bytes) -> bool:
    """True if `text` decodes as z85: whole 5-character groups, each worth less than 2**32."""
    if len(text) % 5:
        return False
    for start in range(0, len(text), 5):
        value = 0
        for char in text[start : start + 5]:
            digit = _Z85_VALUE.get(char)
            if digit is None:
                return False
            value = value * 85 + digit
        if value >= 2**32:
            return False
    return True


def _z85_key(path: str, name: str, value: bytes) -> bytes:
    if len(value) != Z85_KEY_LENGTH:
        raise KeyFileError(
            path, f"{name} must be {Z85_KEY_LENGTH} z85 characters, got {len(value)}"
        )
    if not is_z85(value):
        raise KeyFileError(path, f"{name} is not valid z85")
    return value


def parse_key_text(path: str, text: bytes) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate's text; `path` only names it."""
    public = secret = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(b"public-key"):
            public = line.split(b"=", 1)[1].strip(b" \t'\"")
        elif line.startswith(b"secret-key"):
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    if public is None:
        raise KeyFileError(path, "no public-key line (make key files with `coordd keygen`)")
    public = _z85_key(path, "public-key", public)
    return public, None if secret is None else _z85_key(path, "secret-key", secret)


def read_key_file(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file, as `coordd keygen` writes."""
    try:
        with open(path, "rb") as f:
            text = f.read(65536)
    except OSError as exc:
        raise KeyFileError(path, exc.strerror or str(exc)) from None
    return parse_key_text(path, text)
