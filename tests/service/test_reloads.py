"""Membership changes applied to a serving state, in one process (service/reloads.py).

The administrator's real operations change the devices' superblocks (``admin.deny_server``,
``allow_server``); the state built over them takes what ``Reloads.apply`` makes of the newly
composed store, without a loop or a process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.admin import ServerSpec, allow_server, deny_server
from kvstore.config import compose_membership, load_local
from kvstore.service.changes import FORGOTTEN
from kvstore.service.reloads import Reloads
from kvstore.shm.slots import EMPTY, VALID
from kvstore.testing import free_port_pair

from .harness import Service


@pytest.fixture
def svc(home: Path, file_devices: Any) -> Iterator[Service]:
    s = Service(home, file_devices.make(1, 8 << 20), [f"a=127.0.0.1:{free_port_pair()}",
                                                      f"b=127.0.0.1:{free_port_pair()}"], spare=1)
    yield s
    s.close()


def composed(svc: Service) -> tuple[Any, Any]:
    return compose_membership(load_local(svc.cfg.name, svc.home), svc.home)


def b_page(svc: Service) -> int:
    """A slot of b's area holding a page, as if merged from b."""
    g = svc.st.smap.area_gids(0, 1).start
    svc.st.slots[g]["state"], svc.st.slots[g]["gen"], svc.st.slots[g]["d0"] = VALID, 7, 12345
    svc.st.index.index_slots(np.array([g]))
    return g


def test_denying_a_peer_forgets_its_pages_and_asks_for_new_peers(svc: Service) -> None:
    r = Reloads(svc.st, svc.home)
    g = b_page(svc)
    deny_server(svc.home, svc.cfg, "b")
    assert r.apply(*composed(svc)) is True  # the agent must be re-peered
    assert svc.st.slots["state"][g] == EMPTY and svc.st.cfg.servers[1].denied
    assert [(c.kind, c.gids.tolist()) for c in svc.changes] == [(FORGOTTEN, [g])]
    snap = svc.st.stats.snapshot().service
    assert (snap.areas_dropped, snap.config_reloads) == (1, 1)
    assert not svc.st.stopping


def test_a_peer_allowed_into_the_spare_area_is_a_new_peer_and_no_page_goes(svc: Service) -> None:
    r = Reloads(svc.st, svc.home)
    g = b_page(svc)
    allow_server(svc.home, svc.cfg, ServerSpec.parse(f"c=127.0.0.1:{free_port_pair()}"))
    assert r.apply(*composed(svc)) is True
    assert [s.name for s in svc.st.cfg.servers] == ["a", "b", "c"]
    assert svc.st.slots["state"][g] == VALID and not svc.changes


def test_a_membership_that_goes_back_is_refused_and_nothing_changes(svc: Service) -> None:
    r = Reloads(svc.st, svc.home)
    old = composed(svc)
    deny_server(svc.home, svc.cfg, "b")
    r.apply(*composed(svc))
    with pytest.raises(ValueError, match="went back from generation"):
        r.apply(*old)
    assert svc.st.cfg.servers[1].denied


def test_this_server_denied_stops_the_service_with_the_reason(svc: Service) -> None:
    r = Reloads(svc.st, svc.home)
    deny_server(svc.home, svc.cfg, "a")
    assert r.apply(*composed(svc)) is False
    assert svc.st.stopping and "was denied on store" in svc.st.refused


def test_what_a_reload_cannot_change_is_refused_by_name(svc: Service) -> None:
    r = Reloads(svc.st, svc.home)
    cfg, m = composed(svc)
    for field, value in (("page_size", cfg.page_size * 2), ("devices", ("/elsewhere",))):
        with pytest.raises(ValueError, match=f"the config's {field} changed"):
            r.apply(dataclasses.replace(cfg, **{field: value}), m)
    with pytest.raises(ValueError, match="removed or reordered"):
        r.apply(dataclasses.replace(cfg, servers=cfg.servers[:1]), m)
    assert svc.st.cfg == svc.cfg and not svc.st.stopping
