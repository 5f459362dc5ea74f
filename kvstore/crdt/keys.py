"""CurveZMQ keypairs: one per server and store, kept owner-only under MASS_HOME.

``$MASS_HOME/keys/<store>/<server>.key`` holds two lines, the Z85 public and
secret keys. The public key also goes into the store config, which is what
every peer checks connections against. An administrator who creates a store
on one machine copies each server's key file to that server's MASS_HOME.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from ..config import key_path
from ..errors import NotAllowed


def create_keypair(store: str, server: str, home: Path | None = None) -> str:
    """Create (or replace) a server's keypair; return the Z85 public key."""
    public, secret = zmq.curve_keypair()
    p = key_path(store, server, home)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(public.decode() + "\n" + secret.decode() + "\n")
    os.replace(tmp, p)
    return public.decode()


def load_keypair(store: str, server: str, home: Path | None = None) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a server.

    Raises:
        NotAllowed: the key file is missing or malformed (this machine cannot act as that server).
    """
    p = key_path(store, server, home)
    try:
        lines = p.read_text().split()
    except FileNotFoundError:
        raise NotAllowed(f"no key for server {server!r} of store {store!r} at {p}: copy it from the machine "
                         "where the store was created (mass-ctl kvcache create writes one per server)") from None
    if len(lines) != 2 or len(lines[0]) != 40 or len(lines[1]) != 40:
        raise NotAllowed(f"key file {p} is malformed")
    return lines[0].encode(), lines[1].encode()
