"""CurveZMQ keypairs: one per server and store, kept owner-only under MASS_HOME.

``$MASS_HOME/keys/<store>/<server>.key`` holds two lines, the Z85 public and
secret keys. The public key also goes into the superblocks' membership, which
is what every peer checks connections against. A GPU server makes its own
keypair (``mass-ctl kvcache keygen``) and only the public key travels, to the
administrator's ``allow``; sites that prefer can let ``create``/``allow`` make
it and copy the file themselves.

A machine serves as a server only with that server's private key (``serving_key``):
the key file holding the public key the membership gives the server's area. Nothing
picks a server by name or by being the only one: a machine that connects before it is
allowed, or holds a server's name but not its key, is refused before it writes.
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
        return _read(p)
    except FileNotFoundError:
        raise NotAllowed(f"no key for server {server!r} of store {store!r} at {p}: make one there with "
                         f"'mass-ctl kvcache keygen {store} --server {server}' and have the administrator "
                         "allow its public key") from None


def _read(p: Path) -> tuple[bytes, bytes]:
    lines = p.read_text().split()
    if len(lines) != 2 or len(lines[0]) != 40 or len(lines[1]) != 40:
        raise NotAllowed(f"key file {p} is malformed")
    public, secret = lines[0].encode(), lines[1].encode()
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        raise NotAllowed(f"key file {p} is malformed") from None
    if derived != public:
        raise NotAllowed(f"key file {p}: its public key does not belong to its secret key")
    return public, secret


def local_keys(store: str, home: Path | None = None) -> dict[bytes, Path]:
    """Z85 public key -> key file, for every well-formed keypair of ``store`` on this machine."""
    d = key_path(store, "x", home).parent
    out: dict[bytes, Path] = {}
    for p in sorted(d.glob("*.key")) if d.is_dir() else []:
        try:
            out[_read(p)[0]] = p
        except (NotAllowed, OSError):
            continue
    return out


def keypair_for(store: str, public: bytes, home: Path | None = None) -> tuple[bytes, bytes]:
    """The local keypair whose public key is ``public`` (Z85).

    Raises:
        NotAllowed: no key file here holds it.
    """
    p = local_keys(store, home).get(public)
    if p is None:
        raise NotAllowed(f"no key file under {key_path(store, 'x', home).parent} holds the public key "
                         f"{public.decode()} that the store's membership gives this server: run on the machine "
                         "that made it, or have the administrator allow this machine's key")
    return _read(p)


def serving_key(store: str, server: str, public: str, home: Path | None = None) -> tuple[bytes, bytes]:
    """The keypair this machine serves ``server`` with: the local key file holding ``public``
    (Z85), the key the store's membership gives that server.

    Raises:
        NotAllowed: no key file here holds it (the message says what the operator can do).
    """
    if not public:
        raise NotAllowed(f"server {server!r} of store {store!r} has no key in the membership")
    try:
        return keypair_for(store, public.encode(), home)
    except NotAllowed:
        pass
    p = key_path(store, server, home)
    here = ""
    try:
        here = _read(p)[0].decode()
    except (NotAllowed, OSError):
        pass
    if here:
        raise NotAllowed(f"this machine's key for server {server!r} ({p}, public {here}) is not the one store "
                         f"{store!r} allows for {server!r} ({public}): this is another machine, or the key was "
                         "rotated. Run on the machine that holds it, or have the administrator allow this key "
                         f"('mass-ctl kvcache allow {store} {server} --update --key={here}')")
    raise NotAllowed(f"no key here for server {server!r} of store {store!r}: a machine serves a server only with "
                     f"its private key (the one whose public half the store allows: {public}). Run on the "
                     "machine that holds it")

