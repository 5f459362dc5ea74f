"""mass-ctl: the administrator's and GPU server's command line.

    mass-ctl kvcache create STORE --device PATH... --page-size SIZE --server NAME[=HOST:PORT[:PUBLIC]]...
                            [--area-size SIZE | --spare N]
    mass-ctl kvcache allow STORE NAME[=HOST:PORT] [--key=PUBLIC] [--reuse DENIED] / deny STORE NAME
    mass-ctl kvcache repair STORE
    mass-ctl kvcache keygen STORE [--server NAME]
    mass-ctl kvcache connect STORE [--device PATH]... [--server NAME] [--admin-key HEX]
    mass-ctl kvcache connect STORE [--server NAME] --daemon / disconnect STORE [--server NAME]
    mass-ctl kvcache status STORE [--server NAME] [--json] [--watch]
    mass-ctl kvcache list / show STORE [--json] / dashboard STORE
    mass-ctl kvcache quickstart

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 3 store not
found, 4 refused (not allowed or denied, already running, device mismatch, no
spare area).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ._process import cli_command
from ._units import format_size, parse_size
from .config import (MEMBERSHIP_POLL_S, ServerConfig, StoreConfig, admin_key_path, check_address, check_name,
                     check_page_size, key_path, load_store, mass_home, run_dir, save_store, store_path)
from .errors import AlreadyRunning, DeviceMismatch, KVStoreError, NotAllowed, StoreNotFound

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4


def _err(msg: str) -> None:
    print(f"mass-ctl: error: {msg}", file=sys.stderr)


def cmd_create(a: argparse.Namespace) -> int:
    from .admin import ServerSpec
    from .storage.superblock import BLOCK, MAX_AREAS

    home = mass_home()
    check_name(a.store, "store")
    page_size = check_page_size(parse_size(a.page_size, name="--page-size"))
    if store_path(a.store, home).exists() and not a.force:
        _err(f"store {a.store!r} already exists ({store_path(a.store, home)}); pass --force to replace it")
        return EXIT_REFUSED
    specs = [ServerSpec.parse(s) for s in a.server]
    events = dict(e.partition("=")[::2] for e in (a.events or []))
    for n, addr in events.items():
        ServerConfig(n, "", "", addr)  # validate
    if a.spare is not None and not 0 <= a.spare <= MAX_AREAS - len(specs):
        raise ValueError(f"--spare must be in [0, {MAX_AREAS - len(specs)}] ({MAX_AREAS} areas at most)")
    area_slots = None
    if a.area_size is not None:
        area_slots = parse_size(a.area_size, name="--area-size") // (BLOCK + page_size)
        if area_slots < 1:
            raise ValueError(f"--area-size {a.area_size} holds no slot of {format_size(BLOCK + page_size)} "
                             "(a page plus its 4 KiB header)")
    made: list[str] = []  # files this command created: a refused create removes them again
    rc = EXIT_FAIL
    try:
        rc = _create(a, home, page_size, specs, events, area_slots, made)
        return rc
    finally:
        if rc != EXIT_OK:
            for d in made:
                try:
                    os.unlink(d)
                except OSError:
                    pass


def _create(a: argparse.Namespace, home: Path, page_size: int, specs: list[Any], events: dict[str, str],
            area_slots: int | None, made: list[str]) -> int:
    from .admin import create_store
    from .storage.device import device_size
    from .storage.membership import fingerprint
    from .storage.superblock import areas_that_fit

    seen: dict[str, str] = {}
    for d in a.device:
        real = os.path.realpath(d)
        if real in seen:
            raise ValueError(f"device {d} is given twice" + (f" (as {seen[real]} too)" if seen[real] != d else ""))
        seen[real] = d
        if os.path.isdir(d):
            raise ValueError(f"device {d} is a directory: give a block device or a file")
    for d in a.device:
        if not os.path.exists(d):
            if a.device_size is None:
                _err(f"device {d} does not exist; pass --device-size SIZE to create it as a plain file")
                return EXIT_USAGE
            with open(d, "wb") as f:
                made.append(d)
                f.truncate(parse_size(a.device_size, name="--device-size"))
    sizes = [device_size(d) for d in a.device]
    n_areas = len(specs) + (a.spare or 0)
    if area_slots is not None:
        fit = min(areas_that_fit(sz, page_size, area_slots) for sz in sizes)
        if fit < len(specs):
            raise ValueError(f"--area-size {a.area_size}: the smallest device holds {fit} such area(s), "
                             f"{len(specs)} server(s) need one each")
        n_areas = fit if a.spare is None else min(fit, n_areas)
        if n_areas < len(specs) + (a.spare or 0):
            raise ValueError(f"--area-size {a.area_size} with --spare {a.spare}: the smallest device holds "
                             f"only {fit} area(s)")
    cfg, sbs, made = create_store(home, a.store, a.device, page_size, specs, events=events, force=a.force,
                                  areas=n_areas, area_slots=area_slots)
    _warn_ports([s.name for s in cfg.servers], cfg)
    for d, sb in zip(a.device, sbs):
        per = sb.areas[0].slot_count
        spare = sum(1 for x in sb.areas if x.spare)
        print(f"formatted {d}: {len(sb.areas)} area(s) of {per} slots ({format_size(per * page_size)} each)"
              + (f", {spare} spare for 'allow'" if spare else ""))
    print(f"created store {cfg.name} ({cfg.uuid}), page size {format_size(page_size)}; config "
          f"{store_path(cfg.name, home)}")
    print(f"administrator key {fingerprint(bytes.fromhex(cfg.admin_key))}: its private half stays here "
          f"({admin_key_path(cfg.name, home)}); allow and deny run on this machine")
    remote = [n for n in made if n != _host_name()] if len(specs) > 1 else []
    if remote:
        print(f"keypairs made here for {', '.join(remote)}: copy each {key_path(cfg.name, remote[0], home).parent}"
              "/NAME.key to that server's MASS_HOME/keys/" + cfg.name + "/ (or let each server make its own with "
              "'mass-ctl kvcache keygen' and create with NAME=HOST:PORT:PUBLIC)")
    print(f"servers join with: mass-ctl kvcache connect {cfg.name} --device {a.device[0]}")
    return EXIT_OK


def _host_name() -> str:
    return socket.gethostname().split(".")[0].lower()


def _pick_server(cfg: StoreConfig, name: str | None, home: Path | None = None) -> str:
    """The server this machine serves: ``name``, or the allowed server whose public key a key
    file here holds. Either way this machine must hold that server's private key: no
    fallback (the only server, the host's name) lets a machine run as a server it cannot
    prove to be, since two writers of one area turn each other's pages into misses."""
    from .crdt.serverkeys import local_keys, serving_key

    if name:
        i = cfg.check_allowed(name)
        serving_key(cfg.name, name, cfg.servers[i].public_key, home)
        return name
    mine = local_keys(cfg.name, home)
    matching = [s.name for s in cfg.allowed if s.public_key and s.public_key.encode() in mine]
    if len(matching) == 1:
        return matching[0]
    if matching:
        raise NotAllowed(f"keys for several servers of store {cfg.name!r} are here ({', '.join(matching)}): "
                         "pass --server NAME")
    # no key here is allowed: say why, naming the key files this machine does hold
    by_name = {s.name: s for s in cfg.servers}
    for pub, path in sorted(mine.items(), key=lambda kv: kv[1].name):
        n = path.stem
        if n in by_name and not by_name[n].denied:  # a key of that name, not the allowed one
            serving_key(cfg.name, n, by_name[n].public_key, home)
        if n in by_name and by_name[n].denied:
            raise NotAllowed(f"server {n!r} was denied on store {cfg.name!r}: this machine's key for it is no "
                             f"longer allowed (the administrator gives it back with 'mass-ctl kvcache allow "
                             f"{cfg.name} {n}=HOST:PORT --key={pub.decode()}')")
    if mine:
        pub, path = min(mine.items(), key=lambda kv: kv[1].name)
        n = path.stem
        raise NotAllowed(f"this machine's key for server {n!r} of store {cfg.name!r} is not allowed yet: the "
                         f"administrator runs 'mass-ctl kvcache allow {cfg.name} {n}=HOST:PORT "
                         f"--key={pub.decode()}' on the administrator's machine; then connect again")
    raise NotAllowed(f"no key here matches an allowed server of store {cfg.name!r} "
                     f"({', '.join(s.name for s in cfg.allowed)}): make one with 'mass-ctl kvcache keygen "
                     f"{cfg.name}' and have the administrator run 'mass-ctl kvcache allow {cfg.name} "
                     "NAME=HOST:PORT --key=PUBLIC'")


def _warn_ports(names: list[str], cfg: StoreConfig) -> None:
    from .admin import claims_of, ephemeral_warnings

    for w in ephemeral_warnings([claims_of(s) for s in cfg.servers if s.name in names]):
        print(f"mass-ctl: warning: {w}", file=sys.stderr)


def _tell_running(cfg: StoreConfig, home: Path, generation: int, timeout: float, *, stop_applies: bool = True) -> bool:
    """SIGHUP this machine's services of ``cfg`` (they re-read the superblocks now instead of at
    their next poll), wait until each runs with membership ``generation`` (with ``stop_applies``,
    a service that stopped counts too: a denied server's does) and say which did; returns True
    if some did not in time."""
    from .tui.source import read_service

    pids = {s.name: _running(cfg.name, s.name, home) for s in cfg.servers}
    pending = [n for n, pid in pids.items() if pid]
    for n in pending:
        try:
            os.kill(pids[n], signal.SIGHUP)
        except ProcessLookupError:
            pass
    applied: list[str] = []
    stopped: list[str] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for n in list(pending):
            e = read_service(home, cfg.name, n)
            # stopped (a denied server does), or running with the new membership
            if e["running"] and e["stats"] and e["stats"]["service"]["config_generation"] >= generation:
                applied.append(n)
                pending.remove(n)
            elif not e["running"]:
                (applied if stop_applies else stopped).append(n)
                pending.remove(n)
        time.sleep(0.05)
    if applied:
        print(f"applied by the running service(s) here: {', '.join(sorted(applied))}")
    if stopped:
        _err(f"stopped before it was seen to apply it: {', '.join(sorted(stopped))} (it applies it when it "
             "starts again; see its log for why it stopped)")
    if pending:
        _err(f"not yet applied by: {', '.join(sorted(pending))} (they poll the superblocks every "
             f"{MEMBERSHIP_POLL_S:g} s; see their logs)")
    return bool(pending or stopped)


def cmd_allow(a: argparse.Namespace) -> int:
    from .admin import ServerSpec, allow_server

    home = mass_home()
    cfg = load_store(a.store, home, torn_ok=True)
    spec = ServerSpec.parse(a.server, a.key or "")
    new, index, made = allow_server(home, cfg, spec, reuse=a.reuse, events=a.events or "", metrics=a.metrics or "",
                                    update=a.update)
    print(f"{'updated' if a.update else 'allowed'} server {spec.name} on store {cfg.name}: area {index} on "
          f"{len(cfg.devices)} device(s), membership generation {new.membership_gen}")
    _warn_ports([spec.name], new)
    late = _tell_running(new, home, new.membership_gen, a.timeout)
    if a.update:
        return EXIT_FAIL if late else EXIT_OK
    if made:
        print(f"its keypair was made here: copy {key_path(cfg.name, spec.name, home)} to {spec.name}'s "
              f"MASS_HOME/keys/{cfg.name}/ (or allow its own key: --key=PUBLIC from 'mass-ctl kvcache keygen')")
    print(f"next, on {spec.name}: mass-ctl kvcache connect {cfg.name} --device PATH (machines already serving "
          f"the store pick the change up from the devices within {MEMBERSHIP_POLL_S:g} s)")
    return EXIT_FAIL if late else EXIT_OK


def cmd_deny(a: argparse.Namespace) -> int:
    from .admin import deny_server

    home = mass_home()
    cfg = load_store(a.store, home, torn_ok=True)
    new, index = deny_server(home, cfg, a.server)
    print(f"denied server {a.server} on store {cfg.name}: its key is revoked and its area {index} is no "
          f"longer read (membership generation {new.membership_gen})")
    late = _tell_running(new, home, new.membership_gen, a.timeout)
    print(f"every machine serving the store applies it from the devices within {MEMBERSHIP_POLL_S:g} s; "
          f"its own service stops")
    return EXIT_FAIL if late else EXIT_OK


def cmd_invalidate(a: argparse.Namespace) -> int:
    from .admin import invalidate
    from .storage.superblock import EPOCH_SLOTS

    home = mass_home()
    named = a.tenant is not None or a.namespace is not None
    if bool(a.all) == named:
        _err("name the tenants whose pages to invalidate (--tenant NAME, repeatable; --tenant '' for the "
             "default tenant), their key spaces (--namespace NAME) or --all")
        return EXIT_USAGE
    cfg = load_store(a.store, home, torn_ok=True)
    for t in a.tenant or []:
        if t and t not in cfg.tenants and t not in cfg.namespaces:
            print(f"mass-ctl: warning: tenant {t!r} is in neither [tenants] nor [namespaces] of this machine's "
                  f"config: its own key space is invalidated (check the name: each takes one of the superblock's "
                  f"{EPOCH_SLOTS} epoch places)", file=sys.stderr)
    done = invalidate(home, cfg, None if a.all else a.tenant or [], a.namespace or [])
    new = done.cfg
    what = "every tenant's pages" if done.everyone else \
        "the pages of key space(s) " + ", ".join(done.namespaces)
    print(f"invalidated {what} on store {cfg.name}: key epoch {new.key_epoch}"
          + (f", namespace epochs {', '.join(f'{n}={e}' for n, e in sorted(new.epochs.items()))}" if new.epochs
             else "") + f" (membership generation {new.membership_gen})")
    if done.everyone and not a.all:
        print("the superblock's epoch table was full, so every tenant's key space moved (more misses, never "
              "an old page)")
    late = _tell_running(new, home, new.membership_gen, a.timeout, stop_applies=False)
    print(f"no page saved before is served by a service that applied it; every machine serving the store "
          f"applies it from the devices within {MEMBERSHIP_POLL_S:g} s. Routers that hash with a tenant salt "
          "need the new one")
    return EXIT_FAIL if late else EXIT_OK


def cmd_repair(a: argparse.Namespace) -> int:
    from .admin import repair_store

    home = mass_home()
    check_name(a.store, "store")
    m, fixed = repair_store(home, a.store, [os.path.abspath(p) for p in a.force or []])
    if not fixed:
        print(f"store {a.store}: every device's superblock verifies at membership generation {m.gen}; nothing "
              "to repair")
        return EXIT_OK
    print(f"rewrote the superblocks of device(s) {', '.join(m.paths[i] for i in fixed)} from the membership this "
          f"machine last verified (now generation {m.gen})")
    return EXIT_FAIL if _tell_running(load_store(a.store, home), home, m.gen, a.timeout) else EXIT_OK


def cmd_keygen(a: argparse.Namespace) -> int:
    from .crdt.serverkeys import create_keypair, load_keypair

    home = mass_home()
    check_name(a.store, "store")
    name = a.server or _host_name()
    try:
        check_name(name, "server")
    except ValueError:
        raise ValueError(f"this host's name {name!r} is not a valid server name: pass --server NAME") from None
    p = key_path(a.store, name, home)
    if p.exists() and not a.force:
        public = load_keypair(a.store, name, home)[0].decode()
        print(f"a keypair for server {name} of store {a.store} already exists ({p}); --force replaces it")
    else:
        public = create_keypair(a.store, name, home)
        print(f"made the keypair of server {name} for store {a.store}: {p} (private: it never leaves this machine)")
    print(f"public key: {public}")
    # --key=VALUE, not --key VALUE: a Z85 key may begin with '-', which argparse would take for an option
    print(f"the administrator allows it with: mass-ctl kvcache allow {a.store} {name}=HOST:PORT --key='{public}'")
    return EXIT_OK


def cmd_connect(a: argparse.Namespace) -> int:
    from .logging import configure_logging

    from .service.supervisor import serve

    home = mass_home()
    check_name(a.store, "store")
    if a.device:
        from .admin import join_store
        from .storage.membership import fingerprint

        local, m, trusted = join_store(home, a.store, a.device, a.admin_key)
        if trusted:
            print(f"trusting the administrator key of store {a.store}: {fingerprint(m.admin_key)} (pinned in "
                  f"{store_path(a.store, home)}; check it against 'mass-ctl kvcache show {a.store}' on the "
                  "administrator's machine)", flush=True)
    cfg = load_store(a.store, home)
    server = _pick_server(cfg, a.server, home)
    if _running(cfg.name, server, home):  # before any setting is saved: a refused connect changes nothing
        raise AlreadyRunning(f"a service of store {cfg.name!r} as server {server!r} already runs here "
                             f"(pid {_running(cfg.name, server, home)})")
    if a.metrics is not None or a.events is not None:
        _set_hosted(home, cfg, server, a.metrics, a.events)
        cfg = load_store(a.store, home)
    if a.daemon:
        import subprocess

        rd = run_dir(cfg.name, home)
        rd.mkdir(parents=True, exist_ok=True, mode=0o700)
        logp = rd / f"{server}.log"
        argv, env, cwd = cli_command("kvcache", "connect", cfg.name, "--server", server,
                                     env=dict(os.environ, MASS_HOME=str(home.resolve())))
        with open(logp, "ab") as logf:
            since = logf.tell()
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env, cwd=cwd)
        deadline = time.monotonic() + 120
        # success only once the service answers a client: a pid file alone is a start, not a service
        while not (_running(cfg.name, server, home) == p.pid and _answers(cfg.name, server, home)):
            if p.poll() is not None:
                _err(f"the service exited with code {p.returncode}{_last_error(logp, since)}; see {logp}")
                return EXIT_REFUSED if p.returncode == EXIT_REFUSED else EXIT_FAIL
            if time.monotonic() > deadline:
                _err(f"the service did not come up within 120 s; see {logp}")
                return EXIT_FAIL
            time.sleep(0.05)
        print(f"service of store {cfg.name} as server {server} runs as pid {p.pid}; log {logp}; "
              f"stop it with 'mass-ctl kvcache disconnect {cfg.name} --server {server}'")
        return EXIT_OK
    configure_logging(store=cfg.name, server=server, component="supervisor")
    serve(cfg, server)
    return EXIT_OK


def _device_problem(m: Any, i: int) -> str:
    """What is wrong with device ``i`` of membership ``m`` (one of ``Membership.damaged``), in words."""
    return ("torn: no superblock copy verifies; read from this machine's record" if i in m.torn else
            "rolled back: it holds an older membership than this machine has verified (a replayed or restored "
            "superblock)" if i in m.rolled_back else
            "split: its membership differs from another device's at the same generation (two changes at once)"
            if i in m.split else
            "one superblock copy does not verify (torn, forged or another device's); the other does"
            if i in m.degraded else "lagging: a change did not reach it")


def _answers(store: str, server: str, home: Path) -> bool:
    """Does the service take a client and answer a ping?"""
    from .client import KVCacheClient

    try:
        with KVCacheClient.connect(store, server=server, home=home, timeout=5.0) as c:
            c.ping()
        return True
    except KVStoreError:
        return False


def _last_error(logp: Path, since: int) -> str:
    """': <reason>' from the last 'mass-ctl: error:' line a daemon wrote to its log after
    offset ``since``, or ''."""
    try:
        with open(logp, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errs = [ln.split("error: ", 1)[1] for ln in lines if ln.startswith("mass-ctl: error: ")]
    return f": {errs[-1]}" if errs else ""


def _set_hosted(home: Path, cfg: StoreConfig, name: str, metrics: str | None, events: str | None) -> None:
    """Record this host's metrics/events addresses of server ``name`` in its own config ('' removes
    one), refused if another server (or its own sync) takes the port."""
    from .admin import check_collisions, claims_of
    from .config import load_local

    local = load_local(cfg.name, home)
    h = dict(local.hosted.get(name, {}))
    for what, value, max_port in (("metrics", metrics, 65535), ("events", events, 65534)):
        if value:
            h[what] = check_address(value, f"--{what}", max_port)
        elif value is not None:  # --metrics '': off
            h.pop(what, None)
    me = cfg.servers[cfg.server_index(name)]
    check_collisions([claims_of(s) for s in cfg.servers if not s.denied and s.name != name]
                     + [claims_of(dataclasses.replace(me, events=h.get("events", ""), metrics=h.get("metrics", "")))])
    hosted = {**local.hosted, name: h}
    save_store(dataclasses.replace(local, hosted={n: x for n, x in hosted.items() if x}), home)


def cmd_status(a: argparse.Namespace) -> int:
    if not a.watch:
        return _status_once(a)
    n = 0
    try:
        while a.count is None or n < a.count:
            if n:
                time.sleep(a.interval)
            if not a.json and sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            rc = _status_once(a)
            if rc != EXIT_OK:
                return rc
            n += 1
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _status_once(a: argparse.Namespace) -> int:
    from .tui.source import read_service, with_remote

    from .config import compose_membership, load_local

    home = mass_home()
    local = load_local(a.store, home)
    problems: list[str] = []
    try:  # status works whatever one device holds: it says which device is bad, and shows the services
        cfg, m = compose_membership(local, home, torn_ok=True)
        problems = [f"device {i} ({m.paths[i]}): {_device_problem(m, i)}; 'mass-ctl kvcache repair' on the "
                    "administrator's machine rewrites it" for i in m.damaged]
        names = [s.name for s in cfg.servers]
        denied = {s.name for s in cfg.servers if s.denied}
        page = cfg.page_size
    except KVStoreError as e:
        page = 0
        problems = [f"the membership cannot be read: {e}"]
        rd = run_dir(a.store, home)
        names = sorted(p.stem for p in rd.glob("*.pid")) if rd.is_dir() else []
        denied = set()
    if a.server:
        check_name(a.server, "server")
        if a.server not in names and not problems:
            raise NotAllowed(f"server {a.server!r} is not on store {a.store!r} ({', '.join(names)})")
    # a server on another machine is seen through the local services' sync agents
    every = with_remote({n: {"denied": n in denied, **read_service(home, local.name, n)}
                         for n in dict.fromkeys(names + ([a.server] if a.server else []))})
    out: dict[str, Any] = {"store": local.name, "uuid": local.uuid, "page_size": page or None,
                           "devices": list(local.devices), "problems": problems,
                           "servers": {n: e for n, e in every.items() if not a.server or n == a.server}}
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"store {local.name}  uuid {local.uuid}" + (f"  page size {format_size(page)}" if page else ""))
    for i, d in enumerate(local.devices):
        print(f"  device {i}: {d}")
    for pr in problems:
        print(f"  PROBLEM: {pr}")
    for name, srv in out["servers"].items():
        if not srv["running"]:
            r = srv.get("remote")
            if srv["denied"]:
                print(f"server {name}: DENIED, not running here")
            elif r:
                print(f"server {name}: not running here; heard {r['heard_s']:.1f} s ago by {r['by']}, "
                      f"{r['behind']} updates behind")
            else:
                print(f"server {name}: not running here, and no service here hears it")
            continue
        sv = (srv.get("stats") or {}).get("service", {})
        gets = sv.get("hits", 0) + sv.get("misses", 0)
        hr = sv.get("hits", 0) / gets if gets else 0.0
        print(f"server {name}: running (pid {srv['pid']})")
        print(f"  slots   {sv.get('own_slots_valid', 0)}/{sv.get('own_slots', 0)} own used, "
              f"{sv.get('slots_valid', 0)}/{sv.get('slots_total', 0)} in store")
        print(f"  gets    {gets} pages, hit rate {hr:.1%}; read {format_size(sv.get('bytes_read', 0))}")
        print(f"  puts    {sv.get('put_pages', 0)} pages: {sv.get('pages_written', 0)} written, "
              f"{sv.get('put_skipped', 0)} skipped, {sv.get('put_dropped', 0)} dropped; "
              f"written {format_size(sv.get('bytes_written', 0))}")
        print(f"  faults  {sv.get('validation_failures', 0)} validation failures, {sv.get('io_errors', 0)} "
              f"I/O errors, {sv.get('worker_restarts', 0)} worker restarts; {sv.get('evictions', 0)} evictions")
        print(f"  clients {sv.get('clients_connected', 0)} connected")
        for t, u in sorted(srv.get("tenants", {}).items()):
            q = "unlimited" if u["quota"] is None else u["quota"]
            print(f"  tenant {t or '(default)'}: {u['slots']} slots (quota {q}), "
                  f"{u['pinned']} pinned (pin quota {u['pin_quota']})")
        for p, lag in sorted(srv.get("peers", {}).items()):
            heard = "never heard" if lag["heard_s"] is None else f"heard {lag['heard_s']:.1f} s ago"
            print(f"  peer {p}: {heard}, {lag['behind']} updates behind"
                  + (", catching up" if lag["catching_up"] else ""))
        for w in srv.get("warnings", [])[-3:]:
            extra = ", ".join(f"{k}={v}" for k, v in w.items()
                              if k not in ("event", "level", "timestamp", "store", "server"))
            print(f"  {w.get('level', 'warning')} {str(w.get('timestamp', ''))[11:19]} {w.get('event')}"
                  + (f" ({extra})" if extra else ""))
    return EXIT_OK


def _running(store: str, server: str, home: Path) -> int:
    """Pid of the live service of ``store`` as ``server``, or 0."""
    from .shm.segment import pid_alive

    pidf = run_dir(store, home) / f"{server}.pid"
    try:
        pid = int(pidf.read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return pid if pid_alive(pid) else 0


def cmd_list(a: argparse.Namespace) -> int:
    home = mass_home()
    out: list[dict[str, Any]] = []
    for p in sorted((home / "stores").glob("*.toml")) if (home / "stores").is_dir() else []:
        try:
            cfg = load_store(p.stem, home, torn_ok=True)
        except (ValueError, KVStoreError, OSError) as e:  # one broken store never hides the others
            out.append({"store": p.stem, "error": str(e)})
            continue
        out.append({"store": cfg.name, "page_size": cfg.page_size, "devices": len(cfg.devices),
                    "servers": [s.name for s in cfg.servers], "denied": list(cfg.denied),
                    "running": [s.name for s in cfg.servers if _running(cfg.name, s.name, home)]})
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    if not out:
        print(f"no stores under {home} (create one with 'mass-ctl kvcache create')")
        return EXIT_OK
    print(f"{'STORE':<20}{'PAGE':>10}{'DEVICES':>9}  SERVERS (running*)")
    for r in out:
        if "error" in r:
            print(f"{r['store']:<20}  error: {r['error']}")
            continue
        names = ", ".join(n + ("*" if n in r["running"] else "") + (" (denied)" if n in r["denied"] else "")
                          for n in r["servers"])
        print(f"{r['store']:<20}{format_size(r['page_size']):>10}{r['devices']:>9}  {names}")
    return EXIT_OK


def cmd_show(a: argparse.Namespace) -> int:
    from .crdt.serverkeys import local_keys
    from .storage.device import device_size, read_superblock

    from .config import load_local

    from .config import compose_membership

    home = mass_home()
    local = load_local(a.store, home)
    try:
        cfg, m = compose_membership(local, home, torn_ok=True)
    except KVStoreError as err:  # the devices do not verify: show what they hold, and why
        print(f"store {local.name}  uuid {local.uuid}  membership: ERROR: {err}")
        for i, d in enumerate(local.devices):
            try:
                sb = read_superblock(d)
                mark = "" if sb.store_uuid.hex() == local.uuid.replace("-", "") else \
                    f"  (belongs to ANOTHER store: {sb.store_name!r})"
                print(f"  device {i}: {d}  superblock generation {sb.generation}, membership generation "
                      f"{sb.membership_gen}{mark}")
            except KVStoreError as bad:
                print(f"  device {i}: {d}  ERROR: {bad}")
        return EXIT_FAIL
    devices = []
    for i, d in enumerate(cfg.devices):
        e: dict[str, Any] = {"index": i, "path": d}
        try:
            sb = read_superblock(d)
            e.update({"size": device_size(d), "belongs": sb.store_uuid == cfg.uuid_bytes,
                      "generation": sb.generation, "membership_generation": sb.membership_gen,
                      "areas": [{"server": x.server or None, "slots": x.slot_count, "denied": x.denied}
                                for x in sb.areas]})
        except KVStoreError as err:
            e["error"] = str(err)
        if i in (*m.torn, *m.rolled_back, *m.split, *m.degraded):  # lagging alone has its own mark below
            e["problem"] = _device_problem(m, i) + (
                f" (the device holds generation {e.get('membership_generation')}, this machine has verified "
                f"{cfg.membership_gen})" if i in m.rolled_back else "")
        devices.append(e)
    mine = local_keys(cfg.name, home)
    from .tui.source import read_service, with_remote

    seen = with_remote({s.name: read_service(home, cfg.name, s.name) for s in cfg.servers})
    servers: list[dict[str, Any]] = [{"name": s.name, "area": i, "denied": s.denied, "sync": s.sync or None,
                "public_key": s.public_key or None, "events": s.events or None, "metrics": s.metrics or None,
                "key_here": bool(s.public_key) and s.public_key.encode() in mine,
                "running_pid": _running(cfg.name, s.name, home) or None, "heard": seen[s.name].get("remote")}
               for i, s in enumerate(cfg.servers)]
    out = {"store": cfg.name, "uuid": cfg.uuid, "page_size": cfg.page_size, "admin_key": cfg.admin_key,
           "administered_here": admin_key_path(cfg.name, home).exists(),
           "membership_generation": cfg.membership_gen, "key_epoch": cfg.key_epoch, "epochs": cfg.epochs,
           "devices": devices, "servers": servers,
           "namespaces": cfg.namespaces, "quotas": cfg.quotas, "pin_quotas": cfg.pin_quotas,
           "service": dataclasses.asdict(cfg.service), "worker": dataclasses.asdict(cfg.worker)}
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"store {cfg.name}  uuid {cfg.uuid}  page size {format_size(cfg.page_size)}  membership generation "
          f"{cfg.membership_gen}")
    print(f"  administrator key {cfg.admin_key}" + (" (its private half is here)" if out["administered_here"] else ""))
    if cfg.key_epoch or cfg.epochs:
        print(f"  key epoch {cfg.key_epoch}" + "".join(f", {n} {e}" for n, e in sorted(cfg.epochs.items()))
              + " (pages saved under earlier epochs are never served: 'invalidate')")
    for e in devices:
        if "problem" in e:
            fix = " (run 'mass-ctl kvcache repair " + cfg.name + "' here)" if out["administered_here"] else \
                " (the administrator's 'mass-ctl kvcache repair " + cfg.name + "' rewrites it)"
            print(f"  device {e['index']}: {e['path']}  PROBLEM: {e['problem']}{fix}")
        elif "error" in e:
            print(f"  device {e['index']}: {e['path']}  ERROR: {e['error']}")
        else:
            areas = ", ".join(f"{x['server'] or '(spare)'}={x['slots']}{' DENIED' if x['denied'] else ''}"
                              for x in e["areas"])
            mark = "" if e["belongs"] else "  (belongs to ANOTHER store)"
            lag = "" if e["membership_generation"] == cfg.membership_gen else \
                f"  (membership generation {e['membership_generation']}: the next allow/deny rewrites it)"
            print(f"  device {e['index']}: {e['path']}  {format_size(e['size'])}, slots per area: {areas}{mark}{lag}")
    for s in servers:
        extra = "".join(f", {k} {s[k]}" for k in ("sync", "events", "metrics") if s[k])
        h = s["heard"]
        state = f"running here (pid {s['running_pid']})" if s["running_pid"] else \
            f"not running here, heard {h['heard_s']:.1f} s ago by {h['by']}" if h else "not running here"
        if s["denied"]:
            state = "DENIED, " + state
        key = f", key {s['public_key']}" if s["public_key"] else ""
        print(f"  server {s['name']}: {state}{extra}{key}{', its private key is here' if s['key_here'] else ''}")
    for t, ns in cfg.namespaces.items():
        print(f"  tenant {t} shares namespace {ns}")
    return EXIT_OK


def cmd_disconnect(a: argparse.Namespace) -> int:
    from .config import load_local

    home = mass_home()
    check_name(a.store, "store")
    load_local(a.store, home)  # only this machine's state: a torn or replayed device must not stop a stop
    if a.server:
        server = check_name(a.server, "server")
    else:
        rd = run_dir(a.store, home)
        running = sorted(p.stem for p in rd.glob("*.pid") if _running(a.store, p.stem, home)) if rd.is_dir() else []
        if len(running) > 1:
            raise NotAllowed(f"several services of store {a.store!r} run here ({', '.join(running)}): pass "
                             "--server NAME")
        if not running:
            _err(f"no service of store {a.store!r} runs here")
            return EXIT_NOT_FOUND
        server = running[0]
    pid = _running(a.store, server, home)
    if not pid:
        _err(f"no service of store {a.store!r} as server {server!r} runs here")
        return EXIT_NOT_FOUND
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + a.timeout
    while _running(a.store, server, home) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(a.store, server, home):
        _err(f"service pid {pid} did not stop within {a.timeout} s")
        return EXIT_FAIL
    print(f"stopped the service of store {a.store} as server {server} (pid {pid})")
    return EXIT_OK


def cmd_dashboard(a: argparse.Namespace) -> int:
    from .tui.app import DashboardApp
    from .tui.source import LiveSource

    DashboardApp(LiveSource(a.store), interval=a.interval).run()
    return EXIT_OK


def cmd_quickstart(a: argparse.Namespace) -> int:
    from .quickstart import run_quickstart

    return run_quickstart(pages=a.pages, page_size=parse_size(a.page_size, name="--page-size"))


def _wait_option(c: argparse.ArgumentParser) -> None:
    """--timeout of a membership change: how long it waits for this machine's services."""
    c.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for running services here to apply it (default 10)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mass-ctl", description="Manage kvstore KV-cache stores.",
        epilog="Exit codes: 0 done, 1 failed, 2 bad input, 3 no such store, 4 refused (not allowed or denied, "
               "already running, device mismatch, no spare area). MASS_HOME (default ~/.mass) holds the "
               "store configs, keys and run state.")
    sub = p.add_subparsers(dest="group", required=True)
    kv = sub.add_parser("kvcache", help="shared KV-cache page stores",
                        epilog="Exit codes: 0 done, 1 failed, 2 bad input, 3 no such store, 4 refused.")
    ks = kv.add_subparsers(dest="cmd", required=True)

    c = ks.add_parser("create", help="create a store and format its devices",
                      description="Create a store: write its config under MASS_HOME and format each device "
                                  "(superblock + one area per server). Refuses a device that belongs to "
                                  "another store unless --force.")
    c.add_argument("store")
    c.add_argument("--device", action="append", required=True, metavar="PATH",
                   help="block device or file (repeat for several); order is the device index")
    c.add_argument("--page-size", required=True, metavar="SIZE", help="bytes per page, multiple of 4KiB (e.g. 256KiB)")
    c.add_argument("--server", action="append", required=True, metavar="NAME[=HOST:PORT[:PUBLIC]]",
                   help="allowed server, its sync address and the public key it made with 'keygen' (repeat; "
                        "without a key, its keypair is made here); one area per server per device")
    c.add_argument("--events", action="append", metavar="NAME=HOST:PORT",
                   help="publish vLLM-format KV events of server NAME on PORT (replay on PORT+1); repeatable")
    c.add_argument("--device-size", metavar="SIZE", help="create missing device paths as sparse files of SIZE")
    c.add_argument("--force", action="store_true", help="reformat devices of another store (their pages are lost)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--area-size", metavar="SIZE",
                   help="device space of each server's area on each device, headers included (e.g. 64GiB); "
                        "the rest of the device becomes spare areas of the same size for 'allow'. "
                        "Default: the device split equally among the servers (and --spare)")
    g.add_argument("--spare", type=int, metavar="N",
                   help="split each device into one area per server plus N spare areas for 'allow'")
    c.set_defaults(fn=cmd_create)

    c = ks.add_parser("allow", help="allow a server on a store: give it a spare area and admit its key",
                      description="Assign SERVER a spare area (or give a denied SERVER its area back) with its sync "
                                  "address and public key, signed on every device's superblock. Every machine's "
                                  "running services pick it up from the devices (this machine's at once). Runs "
                                  "where the store was created (it holds the administrator key). Exit 4 when the "
                                  "store has no spare area or SERVER is already allowed.")
    c.add_argument("store")
    c.add_argument("server", metavar="NAME[=HOST:PORT[:PUBLIC]]", help="server name, sync address, public key")
    c.add_argument("--key", metavar="PUBLIC",
                   help="the server's public key, as 'mass-ctl kvcache keygen' printed it there; write it "
                        "--key=PUBLIC (a key may begin with '-') (default: make a keypair here, to be copied "
                        "to the server)")
    c.add_argument("--events", metavar="HOST:PORT", help="where its service publishes vLLM-format KV events")
    c.add_argument("--metrics", metavar="HOST:PORT", help="its Prometheus endpoint")
    c.add_argument("--update", action="store_true",
                   help="change an allowed server's sync address or key (its service picks it up)")
    c.add_argument("--reuse", metavar="DENIED",
                   help="give NAME the area of the denied server DENIED (and the pages in it) instead of a "
                        "spare area; DENIED must be stopped on every machine first, since two writers of one "
                        "area turn each other's pages into misses")
    _wait_option(c)
    c.set_defaults(fn=cmd_allow)

    c = ks.add_parser("deny", help="cut a server off a store: revoke its key, stop reading its area",
                      description="Mark SERVER denied and drop its public key on every device's superblock "
                                  "(signed), and delete its key file here. Every machine's running services drop "
                                  "its pages from their index and stop accepting its connections; its own "
                                  "service stops. Its area keeps its index; 'allow' gives it back. Exit 4 for "
                                  "the last allowed server. deny is membership, not integrity: a denied host "
                                  "that can still reach the devices can read them, destroy or forge pages and "
                                  "replay old superblocks; remove it from the fabric's access list too "
                                  "(NVMe-oF host NQN). docs/SECURITY.md, docs/OPERATIONS.md.")
    c.add_argument("store")
    c.add_argument("server", metavar="NAME")
    _wait_option(c)
    c.set_defaults(fn=cmd_deny)

    c = ks.add_parser("invalidate", help="stop serving tenants' pages (or all) for good, in O(1): after a "
                                         "weight update, a bad deploy",
                      description="Move the key space of each named tenant (its shared namespace, as this "
                                  "machine's [namespaces] maps it), or with --all every tenant's, to a new key "
                                  "epoch, signed on every device's superblock. No page saved before is looked up, "
                                  "loaded or offered again; its slots are reused as space is needed. Running "
                                  "services apply it from the devices (this machine's at once, and it waits for "
                                  "them). Runs where the administrator key is. Tenants are mapped to key spaces "
                                  "by this machine's [namespaces], which must be the same on every machine. The "
                                  "superblock names up to 6 key spaces; invalidating a 7th moves every one.")
    c.add_argument("store")
    c.add_argument("--tenant", action="append", metavar="NAME",
                   help="a tenant whose pages to invalidate (repeatable; '' is the default tenant)")
    c.add_argument("--namespace", action="append", metavar="NAME",
                   help="a key space to invalidate by name (a shared namespace of [namespaces], or a tenant's own)")
    c.add_argument("--all", action="store_true", help="invalidate every tenant's pages")
    _wait_option(c)
    c.set_defaults(fn=cmd_invalidate)

    c = ks.add_parser("repair", help="rewrite torn or replayed superblocks from the last verified membership",
                      description="On the administrator's machine: rewrite every device whose superblock copies "
                                  "are torn or forged, that went back to an older membership (a replayed or "
                                  "restored superblock), that lost one of its two copies, that a change "
                                  "interrupted, or whose membership differs from another device's at the same "
                                  "generation, from the newest membership this machine has verified, signed at "
                                  "the next generation. The membership itself does not change. A torn device is "
                                  "rewritten only if its blocks still name the store and its device index (or "
                                  "with --force PATH). 'status' and 'show' name the devices that need it.")
    c.add_argument("store")
    c.add_argument("--force", action="append", metavar="PATH",
                   help="rewrite this device even though its blocks no longer name the store's device at this path "
                        "(a wiped superblock): you vouch that PATH is that device; repeatable")
    _wait_option(c)
    c.set_defaults(fn=cmd_repair)

    c = ks.add_parser("connect", help="run this server's cache service in the foreground",
                      description="Start the cache service of STORE as this server; Ctrl-C or SIGTERM stops it "
                                  "cleanly. On a machine new to the store, --device PATH is all it needs: the "
                                  "store, its other devices and its membership are read from the devices, and "
                                  "this machine's config is written.")
    c.add_argument("store")
    c.add_argument("--device", action="append", metavar="PATH",
                   help="a device of the store (its other devices are found beside it: other block devices, "
                        "or files in the same directory; repeat to name them)")
    c.add_argument("--admin-key", metavar="HEX",
                   help="the administrator key to trust (default: trust the one the devices name, on first "
                        "use, and print it)")
    c.add_argument("--server", metavar="NAME",
                   help="server name (default: the allowed server whose public key a key file here holds)")
    c.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics here (saved in this "
                   "machine's config; --metrics '' turns it off)")
    c.add_argument("--events", metavar="HOST:PORT", help="publish vLLM-format KV events here (saved in this "
                   "machine's config; --events '' turns it off)")
    c.add_argument("--daemon", action="store_true",
                   help="run in the background (log and pid file in MASS_HOME/run/STORE/); stop with disconnect")
    c.set_defaults(fn=cmd_connect)

    c = ks.add_parser("keygen", help="make this server's keypair for a store and print its public key",
                      description="Make the CurveZMQ keypair this machine uses as SERVER of STORE; the private key "
                                  "stays here, the printed public key goes to the administrator's 'allow'.")
    c.add_argument("store")
    c.add_argument("--server", metavar="NAME", help="server name (default: this host's name)")
    c.add_argument("--force", action="store_true", help="replace an existing keypair")
    c.set_defaults(fn=cmd_keygen)

    c = ks.add_parser("status", help="show a store and its services' statistics")
    c.add_argument("store")
    c.add_argument("--server", metavar="NAME")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--watch", action="store_true", help="repeat until Ctrl-C")
    c.add_argument("--interval", type=float, default=2.0, help="seconds between --watch updates (default 2)")
    c.add_argument("--count", type=int, help="stop --watch after this many updates")
    c.set_defaults(fn=cmd_status)

    c = ks.add_parser("dashboard", help="a live terminal dashboard of the store (q quits, ? help)")
    c.add_argument("store")
    c.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    c.set_defaults(fn=cmd_dashboard)

    c = ks.add_parser("list", help="list the stores under MASS_HOME and which of their services run here")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_list)

    c = ks.add_parser("show", help="a store's configuration, devices (checked against their superblocks) and servers")
    c.add_argument("store")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_show)

    c = ks.add_parser("disconnect", help="stop this machine's service of a store (SIGTERM, then wait)")
    c.add_argument("store")
    c.add_argument("--server", metavar="NAME")
    c.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to stop")
    c.set_defaults(fn=cmd_disconnect)

    c = ks.add_parser("quickstart", help="demo: a temporary store, a service and a synthetic workload",
                      description="Create a store on file-backed devices in a temporary MASS_HOME, start the "
                                  "service, run prompts sharing prefixes through the client library, print hit "
                                  "rate and throughput, and remove everything.")
    c.add_argument("--pages", type=int, default=2048, help="pages of KV written by the workload (default 2048)")
    c.add_argument("--page-size", default="256KiB", help="page size (default 256KiB)")
    c.set_defaults(fn=cmd_quickstart)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mass-ctl``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except StoreNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except (NotAllowed, AlreadyRunning, DeviceMismatch) as e:
        _err(str(e))
        return EXIT_REFUSED
    except ValueError as e:
        _err(str(e))
        return EXIT_USAGE
    except KVStoreError as e:
        _err(str(e))
        return EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_FAIL
    except BrokenPipeError:  # `mass-ctl ... | head`: the reader has gone; no traceback, nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
