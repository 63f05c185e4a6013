"""`coordd keygen`: write CURVE key pairs (NAME.key, NAME.key_secret) for tcp."""

from __future__ import annotations

import argparse
import sys

from coordd.io._curve import write_keypair
from coordd.proto.keyfile import KeyFileError, read_key_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "names",
        nargs="*",
        default=["coordd", "rank"],
        help="one key pair per name (default: coordd rank)",
    )
    p.add_argument("--dir", default=".", help="where to write NAME.key and NAME.key_secret")
    p.add_argument("--force", action="store_true", help="replace existing key files")


def run(args: argparse.Namespace) -> int:
    try:
        for name in args.names:
            public_path, secret_path = write_keypair(args.dir, name, force=args.force)
            public, _ = read_key_file(public_path)
            print(f"{name}: public key {public.decode()}")
            print(f"    {public_path}  (public: give it to the other side)")
            print(f"    {secret_path}  (SECRET: keep it on this host, mode 0600)")
    except (KeyFileError, ValueError, OSError) as exc:
        print(f"coordd keygen: {exc}", file=sys.stderr)
        return 1
    print(
        "coordd takes --curve-secret-key coordd.key_secret --curve-client-keys <rank .key "
        "files or their directory>; a rank takes COORDD_CURVE_SERVER_KEY=coordd.key and "
        "COORDD_CURVE_CLIENT_KEY=<its>.key_secret"
    )
    return 0
