"""CurveZMQ sockets between servers, and the ZAP authenticator that admits only allowed keys.

Each server binds a PUB (deltas, heartbeats) at its sync address and a ROUTER
(anti-entropy) one port above, both as CURVE servers. It connects one SUB and
one DEALER per peer as a CURVE client, pinned to that peer's public key: a
message that arrives on a peer's socket comes from whoever holds that peer's
secret key, which is how records are tied to their owner. The authenticator
(a ZAP handler thread in the agent) admits a connecting client only if its
public key is one of the store's servers'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "kvstore"


class _AllowedKeys:
    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = set(keys)
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            self.denied += 1
        return ok


class Transport:
    """The ZMQ context, authenticator and sockets of one sync agent."""

    def __init__(self, public: bytes, secret: bytes, allowed: Iterable[bytes]) -> None:
        self.ctx = zmq.Context()
        self.public = public
        self.secret = secret
        self.allowed = _AllowedKeys(allowed)
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self.allowed)
        self.sockets: list[zmq.Socket[Any]] = []

    def _server(self, kind: int, endpoint: str) -> zmq.Socket[Any]:
        s = self.ctx.socket(kind)
        s.curve_server = True
        s.curve_publickey = self.public
        s.curve_secretkey = self.secret
        s.zap_domain = ZAP_DOMAIN.encode()
        s.linger = 0
        s.sndhwm = 100_000
        self.sockets.append(s)  # before bind: a socket left open when bind fails would hang close()
        s.bind(endpoint)
        return s

    def _client(self, kind: int, endpoint: str, server_key: bytes) -> zmq.Socket[Any]:
        s = self.ctx.socket(kind)
        s.curve_publickey = self.public
        s.curve_secretkey = self.secret
        s.curve_serverkey = server_key
        s.linger = 0
        s.rcvhwm = 100_000
        self.sockets.append(s)
        return s

    def publisher(self, endpoint: str) -> zmq.Socket[Any]:
        """Bound PUB for our deltas and heartbeats."""
        return self._server(zmq.PUB, endpoint)

    def router(self, endpoint: str) -> zmq.Socket[Any]:
        """Bound ROUTER serving anti-entropy requests."""
        s = self._server(zmq.ROUTER, endpoint)
        s.router_mandatory = False
        return s

    def subscriber(self, endpoint: str, server_key: bytes) -> zmq.Socket[Any]:
        """SUB connected to one peer's PUB."""
        s = self._client(zmq.SUB, endpoint, server_key)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        return s

    def dealer(self, endpoint: str, server_key: bytes, identity: bytes) -> zmq.Socket[Any]:
        """DEALER connected to one peer's ROUTER (our requests, its answers)."""
        s = self._client(zmq.DEALER, endpoint, server_key)
        s.routing_id = identity
        s.connect(endpoint)
        return s

    def close(self) -> None:
        """Close every socket, stop the authenticator, end the context."""
        for s in self.sockets:
            s.close(0)
        self.auth.stop()
        self.ctx.term()
