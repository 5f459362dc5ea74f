"""Tenants granted from credentials (``StoreConfig.tenant_for``) and their config table."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvstore.config import LocalConfig, ServerConfig, ServiceConfig, StoreConfig
from kvstore.errors import NotAllowed


def cfg(**kw: object) -> StoreConfig:
    base: dict[str, object] = dict(servers=(ServerConfig("a"),))
    base.update(kw)
    return StoreConfig(name="s", uuid=str(uuid.uuid4()), page_size=4096, devices=("/dev/null",),
                       **base)  # type: ignore[arg-type]


def test_unmapped_caller_gets_the_default_tenant_only() -> None:
    c = cfg(tenants={"alpha": ["uid:1000"]})
    assert c.tenant_for("", 2000, frozenset({2000})) == ""
    with pytest.raises(NotAllowed, match="uid 2000 may not use tenant 'alpha'"):
        c.tenant_for("alpha", 2000, frozenset({2000}))


def test_mapped_by_uid_or_group() -> None:
    c = cfg(tenants={"alpha": ["uid:1000"], "beta": ["gid:50", "uid:1000"], "gamma": ["gid:60"]})
    assert c.tenants_of(1000, frozenset({1000})) == ["alpha", "beta"]
    assert c.tenant_for("beta", 1000, frozenset()) == "beta"
    with pytest.raises(NotAllowed, match="several tenants"):
        c.tenant_for("", 1000, frozenset())                 # must name one of its two
    assert c.tenant_for("", 7, frozenset({60})) == "gamma"   # its only tenant, through a group
    with pytest.raises(NotAllowed, match="several tenants"):
        c.tenant_for("", 7, frozenset({60, 50}))            # gamma and beta through two groups


def test_declared_tenants_only_where_the_config_says_so() -> None:
    c = cfg(tenants={"alpha": ["uid:1000"]})
    with pytest.raises(NotAllowed):
        c.tenant_for("anyone", 1000, frozenset())
    trusting = dataclasses.replace(c, service=ServiceConfig(trust_declared_tenant=True))
    assert trusting.tenant_for("anyone", 5, frozenset()) == "anyone"
    with pytest.raises(ValueError, match="tenant"):
        trusting.tenant_for("Bad Name", 5, frozenset())


@pytest.mark.parametrize("bad", [[], ["alice"], ["uid:x"], ["user:no-such-user-here"], ["host:1"], "uid:1"])
def test_bad_principals_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="tenant"):
        cfg(tenants={"alpha": bad})


def test_local_part_round_trips_through_toml_and_membership_stays_out() -> None:
    c = cfg(tenants={"alpha": ["uid:1000", "gid:5"]}, service=ServiceConfig(trust_declared_tenant=True),
            servers=(ServerConfig("a", "127.0.0.1:7000", "k" * 40, metrics="127.0.0.1:9100"),
                     ServerConfig("b", "127.0.0.1:7002", "j" * 40)))
    text = c.to_toml()
    back = LocalConfig.from_toml(text)
    assert back.tenants == c.tenants and back.service.trust_declared_tenant
    assert back.hosted == {"a": {"metrics": "127.0.0.1:9100"}}  # this host's addresses only
    assert "k" * 40 not in text and "127.0.0.1:7000" not in text and c.salt not in text  # on the devices
    again = back.compose(c.page_size, bytes.fromhex(c.salt), [("a", "127.0.0.1:7000", "k" * 40, False),
                                                              ("b", "127.0.0.1:7002", "j" * 40, False)], 3)
    assert dataclasses.replace(again, membership_gen=0) == c


def test_config_of_the_old_format_is_refused_with_what_to_do() -> None:
    old = '[store]\nname = "s"\nuuid = "%s"\npage_size = 4096\ndevices = ["/dev/null"]\nsalt = "00"\n' \
          '[[servers]]\nname = "a"\n' % uuid.uuid4()
    with pytest.raises(ValueError, match="before membership moved to the devices"):
        LocalConfig.from_toml(old)
    with pytest.raises(ValueError, match=r"\[servers.a\]: unknown setting"):
        LocalConfig.from_toml(cfg().to_toml() + '\n[servers.a]\nsync = "127.0.0.1:1"\n')


def test_key_epochs_move_exactly_the_key_spaces_they_name() -> None:
    store = cfg(namespaces={"t1": "shared", "t2": "shared"})
    before = {t: store.tenant_salt(t) for t in ("", "t1", "t2", "t3")}
    assert before["t1"] == before["t2"] and len(set(before.values())) == 3
    assert store.namespace_of("t1") == "shared" and store.namespace_of("") == ":default"
    one = dataclasses.replace(store, epochs={"shared": 1})
    assert {t: one.tenant_salt(t) != before[t] for t in before} == {"": False, "t1": True, "t2": True, "t3": False}
    assert one.tenant_salt("t1") == one.tenant_salt("t2")
    default = dataclasses.replace(store, epochs={":default": 1})
    assert {t for t in before if default.tenant_salt(t) != before[t]} == {""}
    every = dataclasses.replace(store, key_epoch=1)
    assert all(every.tenant_salt(t) != before[t] for t in before)
    # (key epoch, namespace epoch) pairs give distinct salts: (1, 0) is not (0, 1)
    assert dataclasses.replace(store, key_epoch=1).tenant_salt("t3") != \
        dataclasses.replace(store, epochs={"t3": 1}).tenant_salt("t3")
