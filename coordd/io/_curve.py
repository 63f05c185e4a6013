"""CURVE for coordd over tcp: key files, the checks on the bind options, and the ZAP gate.

A tcp bind is refused unless CURVE is configured (coordd's secret key and the public keys of
the clients it admits) or `--insecure` is given. With CURVE, libzmq encrypts every connection
and asks a ZAP handler (`coordd.io._gate.HandshakeGate`, in its own thread, once per connection
handshake, never per message) whether the client's public key is one coordd was given (the
same handler refuses handshakes while coordd is over its memory budget);
`ZAP_ENFORCE_DOMAIN` makes the socket refuse every client if that handler were missing.

Key files use ZeroMQ's certificate format (as `zmq.auth` reads them): `NAME.key` holds the
public key, `NAME.key_secret` the pair; `coordd keygen` writes both with mode 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from coordd.core import _logs as logs
from coordd.core._bounds import Throttle
from coordd.core._grants import ANY, Grant, refusal, split_entry
from coordd.proto.keyfile import KeyFileError, read_key_file

log = logging.getLogger("coordd")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "coordd"
#: A refused key is logged at most this often (a client retries its handshake every second).
REFUSAL_LOG_INTERVAL = 60.0
#: The refusal limiter remembers at most this many keys (the least recently refused go first),
#: and logs at most REFUSAL_LINES refusals per REFUSAL_LOG_INTERVAL, whatever the keys: the
#: rest are counted into the next line (`suppressed=N`). 200,000 fresh keys cost a few lines
#: and a bounded table, not 200,000 of each.
REFUSAL_KEYS_KEPT = 1024
REFUSAL_LINES = 20

_SECRET_BANNER = (
    "#   ZeroMQ CURVE **Secret** Certificate, written by coordd keygen\n"
    "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n"
)
_PUBLIC_BANNER = (
    "#   ZeroMQ CURVE Public Certificate, written by coordd keygen\n"
    "#   Give it to the other side: coordd needs each client's, clients need coordd's.\n\n"
)


class SecurityConfigError(ValueError):
    """The bind and CURVE options do not make a safe, complete configuration."""


def check_security_options(
    bind: str, secret_key: str | None, client_keys: Sequence[str], insecure: bool
) -> bool:
    """Validate the options (reading no file); True if CURVE is to be used."""
    if secret_key and insecure:
        raise SecurityConfigError(
            "--insecure contradicts --curve-secret-key: give one or the other"
        )
    if secret_key and not client_keys:
        raise SecurityConfigError(
            "--curve-secret-key needs --curve-client-keys: coordd admits only the client "
            "public keys it is given"
        )
    if client_keys and not secret_key:
        raise SecurityConfigError(
            "--curve-client-keys needs --curve-secret-key (coordd's own NAME.key_secret)"
        )
    for entry in client_keys:
        try:
            split_entry(entry)
        except ValueError as exc:
            raise SecurityConfigError(f"--curve-client-keys {entry}: {exc}") from None
    if bind.startswith("tcp://") and not secret_key and not insecure:
        raise SecurityConfigError(
            f"a tcp bind ({bind}) needs CURVE: give --curve-secret-key and --curve-client-keys "
            "(make them with `coordd keygen`), or --insecure to accept unauthenticated ranks"
        )
    return bool(secret_key)


# -- key files ---------------------------------------------------------------------------------


def _write_temp(directory: str, name: str, text: str) -> str:
    """A new 0600 file beside the final one, never through a link, whatever the umask."""
    for attempt in range(100):
        path = os.path.join(directory, f".{name}.{os.getpid()}.{attempt}.tmp")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="ascii") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return path
    raise KeyFileError(os.path.join(directory, name), "no free temporary name beside it")


def _place(temps: Sequence[tuple[str, str]], force: bool) -> None:
    """Move the finished files into place: all of them, or (without --force) none.

    `os.replace` swaps a planted link itself, never its target; `os.link` refuses to replace
    anything, so a half-written pair cannot come from a name that was already taken."""
    if force:
        for temp, final in temps:
            os.replace(temp, final)
        return
    placed: list[str] = []
    try:
        for temp, final in temps:
            try:
                os.link(temp, final, follow_symlinks=False)
            except FileExistsError:
                raise KeyFileError(final, "exists (pass --force to replace it)") from None
            placed.append(final)
    except BaseException:
        for final in placed:
            os.unlink(final)
        raise
    finally:
        for temp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


def write_keypair(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (mode 0600) as a pair; returns their paths.

    Both files are new, or (with `force`) both are replaced: never a public key from one pair
    beside the secret of another."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub = public.decode("ascii")
    public_path = os.path.join(directory, name + PUBLIC_SUFFIX)
    secret_path = os.path.join(directory, name + SECRET_SUFFIX)
    if not force:
        for path in (public_path, secret_path):
            if os.path.lexists(path):
                raise KeyFileError(path, "exists (pass --force to replace it)")
    body = f'metadata\ncurve\n    public-key = "{pub}"\n'
    secret_text = _SECRET_BANNER + body + f'    secret-key = "{secret.decode("ascii")}"\n'
    temps: list[tuple[str, str]] = []
    try:
        temps.append((_write_temp(directory, name + SECRET_SUFFIX, secret_text), secret_path))
        temps.append(
            (_write_temp(directory, name + PUBLIC_SUFFIX, _PUBLIC_BANNER + body), public_path)
        )
        _place(temps, force)
    finally:
        for temp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
    return public_path, secret_path


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """coordd's own (public, secret) from NAME.key_secret; warns if others may read it."""
    public, secret = read_key_file(path)
    if secret is None:
        raise KeyFileError(path, "has no secret-key: give coordd's NAME.key_secret file")
    try:
        mode = os.stat(path).st_mode
    except OSError:  # pragma: no cover - read_key_file just read it
        mode = 0
    if mode & stat.S_IROTH:
        log.warning("CURVE secret key %s is readable by other users (mode %o)", path, mode & 0o777)
    return public, secret


#: A client key file named `rank<N>.key` admits its key for dp_rank N only.
_RANK_KEY_FILE = re.compile(r"rank(\d+)" + re.escape(PUBLIC_SUFFIX))


def _key_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(PUBLIC_SUFFIX))
        if not files:
            raise KeyFileError(path, f"directory holds no *{PUBLIC_SUFFIX} file")
        return files
    return [path]


def load_grants(entries: Sequence[str]) -> dict[bytes, frozenset[Grant]]:
    """Each admitted client key (z85) -> what it may register as (`coordd.core._grants`): with
    one key per rank (and group), a leaked key speaks for its own rank (of its own group) only.
    A key given once without a binding may register as anything."""
    grants: dict[bytes, frozenset[Grant]] = {}
    for entry in entries:
        given, path = split_entry(entry)
        for file in _key_files(path):
            public, _ = read_key_file(file)
            named = _RANK_KEY_FILE.fullmatch(os.path.basename(file))
            rank = given.rank if given is not None else None
            last = given.last if given is not None else None
            if rank is None and named:
                rank = int(named.group(1))
            grant = Grant(given.group if given is not None else None, rank, last)
            grants[public] = grants.get(public, frozenset()) | {grant}
    return grants


def load_client_keys(paths: Sequence[str]) -> dict[bytes, str]:
    """Admitted client public keys (z85) -> the file each came from: each path is a key file
    or a directory whose *.key files are read (an entry's binding head: `coordd.core._grants`)."""
    keys: dict[bytes, str] = {}
    for entry in paths:
        path = split_entry(entry)[1]
        if os.path.isdir(path):
            files = sorted(
                os.path.join(path, n) for n in os.listdir(path) if n.endswith(PUBLIC_SUFFIX)
            )
            if not files:
                raise KeyFileError(path, f"directory holds no *{PUBLIC_SUFFIX} file")
        else:
            files = [path]
        for file in files:
            public, _ = read_key_file(file)
            keys.setdefault(public, file)
    if not keys:
        raise SecurityConfigError("no client public key given: coordd would admit nobody")
    return keys


# -- the ZAP gate ------------------------------------------------------------------------------


@dataclass
class CurveGate:
    """coordd's CURVE identity and the ZAP handler that admits only the given client keys."""

    public: bytes
    secret: bytes
    allowed: dict[bytes, str]
    refused: int = 0
    #: What each key may register as (`load_grants`); a key not here may be anything.
    grants: dict[bytes, frozenset[Grant]] = field(default_factory=dict)
    _auth: Any = None
    #: The group's fields for the refusal's log line (set by `coordd serve`; read from the
    #: authenticator's thread, which only reads).
    where: Callable[[], dict[str, Any]] = field(
        default=lambda: logs.fault_fields(group="-", epoch=0, seq=0, kind="connect", ranks=[])
    )
    #: a key's refusal logged at most once per interval, REFUSAL_LINES lines per interval
    _throttle: Throttle = field(
        default_factory=lambda: Throttle(
            REFUSAL_LOG_INTERVAL, keys=REFUSAL_KEYS_KEPT, lines=REFUSAL_LINES
        )
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, context: zmq.Context, secret_key: str, client_keys: Sequence[str]) -> CurveGate:
        """Load the keys and start the authenticator on `context` (before any bind)."""
        from coordd.io._gate import HandshakeGate

        public, secret = load_secret_key(secret_key)
        gate = cls(public, secret, load_client_keys(client_keys))
        gate.grants = load_grants(client_keys)
        # coordd's own ZAP handler (not pyzmq's authenticator): the same one refuses
        # handshakes while coordd is over its memory budget (status 300; an unknown key 400)
        auth = HandshakeGate.start(context, curve=gate.callback)
        if auth is None:
            raise SecurityConfigError("another ZAP handler serves this ZeroMQ context")
        gate._auth = auth
        log.info(
            "CURVE on: coordd key %s, %d client key(s) admitted",
            public.decode("ascii"),
            len(gate.allowed),
        )
        return gate

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question (in its thread): admit this client (`key`: z85)?"""
        if domain == ZAP_DOMAIN and key in self.allowed:
            return True
        self.refused += 1
        now = time.monotonic()
        with self._lock:
            if not self._throttle.admit(key, now):
                return False
            suppressed = self._throttle.held_all()
        extra = {"suppressed": suppressed} if suppressed else {}
        logs.event(
            log,
            logging.WARNING,
            "client refused",
            **self.where(),
            reason="curve_key",
            key=key.decode("ascii", "replace"),
            detail=f"CURVE key not among the {len(self.allowed)} admitted",
            **extra,
        )
        return False

    @property
    def binds(self) -> bool:
        """Whether some key is bound (to a rank or a group): Hellos are then checked."""
        return any(ANY not in held for held in self.grants.values())

    def key_refusal(self, user_id: str, group: str, rank: int) -> str | None:
        """Why a connection authenticated with key `user_id` (z85, the ZAP User-Id) may not
        register as `rank` of `group`, or None if it may (checked at its Hello)."""
        key = user_id.encode("ascii", "replace")
        why = refusal(self.grants.get(key, (ANY,)), group, rank)
        if why is None:
            return None
        return f"its CURVE key ({os.path.basename(self.allowed.get(key, '?'))}) is {why}"

    def configure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server that asks this gate (call before bind)."""
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def stop(self) -> None:
        auth = self._auth
        self._auth = None
        if auth is not None:
            auth.stop()


def relay_curve_client(server_key: str, secret_key: str | None) -> Callable[[zmq.Socket], None]:
    """A relay's CURVE client setup: the root's public key (`server_key`, a .key file) and the
    relay's own key pair (`secret_key`, a .key_secret file, which the root binds to the ranks
    the relay may speak for). `SecurityConfigError` if one is missing or unreadable."""
    if not secret_key:
        raise SecurityConfigError(
            "--relay-curve-server-key needs --relay-curve-key: the relay's own secret key"
        )
    try:
        server_public, _ = read_key_file(server_key)
        public, secret = load_secret_key(secret_key)
    except KeyFileError as exc:
        raise SecurityConfigError(str(exc)) from None

    def configure(sock: zmq.Socket) -> None:
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret

    return configure
