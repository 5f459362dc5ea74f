"""mass-ctl: the administrator's and GPU server's command line.

    mass-ctl kvcache create STORE --device PATH... --page-size SIZE --server NAME[=HOST:PORT]...
                            [--area-size SIZE | --spare N]
    mass-ctl kvcache allow STORE NAME[=HOST:PORT] [--reuse DENIED] / deny STORE NAME
    mass-ctl kvcache connect STORE [--server NAME]
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
import uuid
from pathlib import Path
from typing import Any

from ._units import format_size, parse_size
from .config import (ServerConfig, StoreConfig, check_name, check_page_size, key_path, load_store,
                     mass_home, run_dir, save_store, store_path)
from .errors import AlreadyRunning, DeviceMismatch, KVStoreError, NotAllowed, StoreNotFound

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4


def _err(msg: str) -> None:
    print(f"mass-ctl: error: {msg}", file=sys.stderr)


def cmd_create(a: argparse.Namespace) -> int:
    from .storage.device import device_size, format_device
    from .storage.superblock import BLOCK, MAX_AREAS, areas_that_fit

    home = mass_home()
    check_name(a.store, "store")
    page_size = check_page_size(parse_size(a.page_size, name="--page-size"))
    if store_path(a.store, home).exists() and not a.force:
        _err(f"store {a.store!r} already exists ({store_path(a.store, home)}); pass --force to replace it")
        return EXIT_REFUSED
    from .crdt.keys import create_keypair

    specs = [s.partition("=") for s in a.server]
    for n, _, sync in specs:
        ServerConfig(n, sync)  # validate names and addresses before anything is written
    store_uuid = str(uuid.uuid4())
    StoreConfig(name=a.store, uuid=store_uuid, page_size=page_size, devices=tuple(a.device),
                servers=tuple(ServerConfig(n, sync) for n, _, sync in specs))
    events = dict(e.partition("=")[::2] for e in (a.events or []))
    unknown = set(events) - {n for n, _, _ in specs}
    if unknown:
        raise ValueError(f"--events names servers that are not in --server: {sorted(unknown)}")
    for n, addr in events.items():
        ServerConfig(n, "", "", addr)  # validate
    servers = [ServerConfig(n, sync, create_keypair(a.store, n, home), events.get(n, "")) for n, _, sync in specs]
    cfg = StoreConfig(name=a.store, uuid=store_uuid, page_size=page_size, devices=tuple(a.device),
                      servers=tuple(servers))
    if a.spare is not None and not 0 <= a.spare <= MAX_AREAS - len(servers):
        raise ValueError(f"--spare must be in [0, {MAX_AREAS - len(servers)}] ({MAX_AREAS} areas at most)")
    area_slots = None
    if a.area_size is not None:
        area_slots = parse_size(a.area_size, name="--area-size") // (BLOCK + page_size)
        if area_slots < 1:
            raise ValueError(f"--area-size {a.area_size} holds no slot of {format_size(BLOCK + page_size)} "
                             "(a page plus its 4 KiB header)")
    for d in a.device:
        if not os.path.exists(d):
            if a.device_size is None:
                _err(f"device {d} does not exist; pass --device-size SIZE to create it as a plain file")
                return EXIT_USAGE
            with open(d, "wb") as f:
                f.truncate(parse_size(a.device_size, name="--device-size"))
    sizes = [device_size(d) for d in a.device]
    n_areas = len(servers) + (a.spare or 0)
    if area_slots is not None:
        fit = min(areas_that_fit(sz, page_size, area_slots) for sz in sizes)
        if fit < len(servers):
            raise ValueError(f"--area-size {a.area_size}: the smallest device holds {fit} such area(s), "
                             f"{len(servers)} server(s) need one each")
        n_areas = fit if a.spare is None else min(fit, n_areas)
        if n_areas < len(servers) + (a.spare or 0):
            raise ValueError(f"--area-size {a.area_size} with --spare {a.spare}: the smallest device holds "
                             f"only {fit} area(s)")
    for i, d in enumerate(a.device):
        sb = format_device(d, store_uuid=cfg.uuid_bytes, store_name=cfg.name, page_size=page_size,
                           device_index=i, device_count=len(a.device), servers=[s.name for s in servers],
                           force=a.force, areas=n_areas, area_slots=area_slots)
        per = sb.areas[0].slot_count
        spare = sum(1 for x in sb.areas if x.spare)
        print(f"formatted {d}: {len(sb.areas)} area(s) of {per} slots ({format_size(per * page_size)} each)"
              + (f", {spare} spare for 'allow'" if spare else ""))
    p = save_store(cfg, home)
    print(f"created store {cfg.name} ({cfg.uuid}), page size {format_size(page_size)}; config {p}")
    if len(servers) > 1:
        print(f"server keys are in {key_path(cfg.name, servers[0].name, home).parent}: copy each server's "
              ".key file and the config to that server's MASS_HOME")
    return EXIT_OK


def _pick_server(cfg: StoreConfig, name: str | None) -> str:
    if name:
        cfg.check_allowed(name)
        return name
    if len(cfg.allowed) == 1:
        return cfg.allowed[0].name
    host = socket.gethostname().split(".")[0].lower()
    if any(s.name == host for s in cfg.allowed):
        return host
    raise NotAllowed(f"store {cfg.name!r} has servers {[s.name for s in cfg.allowed]}: pass --server NAME")


def _tell_running(cfg: StoreConfig, home: Path, generation: int, timeout: float) -> bool:
    """SIGHUP this machine's services of ``cfg``, wait until each runs with ``generation`` (a denied
    server's service stops instead) and say which did; returns True if some did not in time."""
    from .tui.source import read_service

    pids = {s.name: _running(cfg.name, s.name, home) for s in cfg.servers}
    pending = [n for n, pid in pids.items() if pid]
    for n in pending:
        try:
            os.kill(pids[n], signal.SIGHUP)
        except ProcessLookupError:
            pass
    applied: list[str] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for n in list(pending):
            e = read_service(home, cfg.name, n)
            # stopped (a denied server does), or running with the new membership
            if not e["running"] or (e["stats"] and e["stats"]["service"]["config_generation"] >= generation):
                applied.append(n)
                pending.remove(n)
        time.sleep(0.05)
    if applied:
        print(f"applied by the running service(s) here: {', '.join(sorted(applied))}")
    if pending:
        _err(f"not yet applied by: {', '.join(sorted(pending))} (they re-read the config every 0.5 s; "
             "see their logs)")
    return bool(pending)


def _set_area_everywhere(cfg: StoreConfig, index: int, server: str, denied: bool) -> int:
    """Rewrite area ``index`` in every device's superblock; returns device 0's new generation."""
    from .storage.device import set_area

    gens = [set_area(d, store_uuid=cfg.uuid_bytes, index=index, server=server, denied=denied).generation
            for d in cfg.devices]
    return gens[0]


def cmd_allow(a: argparse.Namespace) -> int:
    from .crdt.keys import create_keypair
    from .storage.device import verify_store

    home = mass_home()
    cfg = load_store(a.store, home)
    name, _, sync = a.server.partition("=")
    fresh = ServerConfig(check_name(name, "server"), sync, events=a.events or "", metrics=a.metrics or "")
    sbs = verify_store(cfg)
    existing = {s.name: i for i, s in enumerate(cfg.servers)}
    if name in existing and not cfg.servers[existing[name]].denied:
        raise NotAllowed(f"server {name!r} is already allowed on store {cfg.name!r}")
    if a.reuse is not None:
        # give a denied server's area (and the pages in it) to a new server
        ri = cfg.server_index(a.reuse)
        if not cfg.servers[ri].denied:
            raise NotAllowed(f"--reuse {a.reuse}: that server is not denied (deny it first, and stop it)")
        if name in existing:
            raise NotAllowed(f"--reuse: server {name!r} is already on store {cfg.name!r}")
        pid = _running(cfg.name, a.reuse, home)
        if pid:
            raise NotAllowed(f"--reuse {a.reuse}: its service still runs here (pid {pid}); stop it first")
        index, sv = ri, fresh
    elif name in existing:
        index = existing[name]
        old = cfg.servers[index]
        sv = dataclasses.replace(old, sync=sync or old.sync, events=a.events or old.events,
                                 metrics=a.metrics or old.metrics, denied=False)
    else:
        index, sv = len(cfg.servers), fresh
    servers = list(cfg.servers)
    servers[index:index + 1] = [sv]  # replaces, or appends at the end
    try:
        dataclasses.replace(cfg, servers=tuple(servers))  # validates: sync addresses, server count
    except ValueError as e:
        if "needs a sync address" in str(e) and sync:
            raise ValueError(f"{e}: set its sync = \"HOST:PORT\" in {store_path(cfg.name, home)}, restart its "
                             "service, then allow again") from None
        raise
    if index >= len(sbs[0].areas):
        raise NotAllowed(
            f"store {cfg.name!r} has no spare area: its {len(sbs[0].areas)} area(s) per device are all "
            f"assigned. Give it the area of a denied server (--reuse NAME), or recreate the store with "
            f"--area-size or --spare to leave room for more servers")
    sv = dataclasses.replace(sv, public_key=create_keypair(cfg.name, name, home))
    servers[index] = sv
    new = dataclasses.replace(cfg, servers=tuple(servers))
    gen = _set_area_everywhere(new, index, name, denied=False)  # devices first: services verify against them
    save_store(new, home)
    slots = sum(sb.areas[index].slot_count for sb in sbs)  # allow renames an area, never resizes it
    print(f"allowed server {name} on store {cfg.name}: area {index}, {slots} slots "
          f"({format_size(slots * cfg.page_size)}) over {len(cfg.devices)} device(s)")
    late = _tell_running(new, home, gen, a.timeout)
    print(f"next: copy {store_path(cfg.name, home)} to every server's MASS_HOME/stores/ and "
          f"{key_path(cfg.name, name, home)} to {name}'s MASS_HOME/keys/{cfg.name}/, then run "
          f"'mass-ctl kvcache connect {cfg.name} --server {name}' there")
    return EXIT_FAIL if late else EXIT_OK


def cmd_deny(a: argparse.Namespace) -> int:
    from .storage.device import verify_store

    home = mass_home()
    cfg = load_store(a.store, home)
    index = cfg.server_index(a.server)
    if cfg.servers[index].denied:
        raise NotAllowed(f"server {a.server!r} is already denied on store {cfg.name!r}")
    if len(cfg.allowed) == 1:
        raise NotAllowed(f"server {a.server!r} is the last allowed server of store {cfg.name!r}: "
                         "a store needs at least one")
    verify_store(cfg)
    servers = list(cfg.servers)
    servers[index] = dataclasses.replace(servers[index], denied=True, public_key="")
    new = dataclasses.replace(cfg, servers=tuple(servers))
    gen = _set_area_everywhere(new, index, a.server, denied=True)
    save_store(new, home)
    key = key_path(cfg.name, a.server, home)
    key.unlink(missing_ok=True)
    print(f"denied server {a.server} on store {cfg.name}: its key is revoked and its area {index} is no "
          "longer read")
    late = _tell_running(new, home, gen, a.timeout)
    print(f"next: copy {store_path(cfg.name, home)} to every other server's MASS_HOME/stores/")
    return EXIT_FAIL if late else EXIT_OK


def cmd_connect(a: argparse.Namespace) -> int:
    from .logging import configure_logging
    from .service.supervisor import serve

    cfg = load_store(a.store)
    server = _pick_server(cfg, a.server)
    home = mass_home()
    if _running(cfg.name, server, home):
        raise AlreadyRunning(f"a service of store {cfg.name!r} as server {server!r} already runs here "
                             f"(pid {_running(cfg.name, server, home)})")
    if a.daemon:
        import subprocess

        rd = run_dir(cfg.name, home)
        rd.mkdir(parents=True, exist_ok=True, mode=0o700)
        logp = rd / f"{server}.log"
        with open(logp, "ab") as logf:
            p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "kvcache", "connect", cfg.name, "--server",
                                  server], stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=dict(os.environ, MASS_HOME=str(home)))
        deadline = time.monotonic() + 120
        while _running(cfg.name, server, home) != p.pid:
            if p.poll() is not None:
                _err(f"the service exited with code {p.returncode}; see {logp}")
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
    from .tui.source import read_service

    home = mass_home()
    cfg = load_store(a.store, home)
    servers = [a.server] if a.server else [s.name for s in cfg.servers]
    out: dict[str, Any] = {"store": cfg.name, "uuid": cfg.uuid, "page_size": cfg.page_size,
                           "devices": list(cfg.devices), "servers": {}}
    for name in servers:
        i = cfg.server_index(name)
        out["servers"][name] = {"denied": cfg.servers[i].denied, **read_service(home, cfg.name, name)}
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"store {cfg.name}  uuid {cfg.uuid}  page size {format_size(cfg.page_size)}")
    for i, d in enumerate(cfg.devices):
        print(f"  device {i}: {d}")
    for name, srv in out["servers"].items():
        if not srv["running"]:
            print(f"server {name}: {'DENIED, ' if srv['denied'] else ''}not running")
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
            cfg = load_store(p.stem, home)
        except ValueError as e:
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
    from .storage.device import device_size, read_superblock

    home = mass_home()
    cfg = load_store(a.store, home)
    devices = []
    for i, d in enumerate(cfg.devices):
        e: dict[str, Any] = {"index": i, "path": d}
        try:
            sb = read_superblock(d)
            e.update({"size": device_size(d), "belongs": sb.store_uuid == cfg.uuid_bytes,
                      "generation": sb.generation,
                      "areas": [{"server": x.server or None, "slots": x.slot_count, "denied": x.denied}
                                for x in sb.areas]})
        except KVStoreError as err:
            e["error"] = str(err)
        devices.append(e)
    servers = [{"name": s.name, "area": i, "denied": s.denied, "sync": s.sync or None, "events": s.events or None, "metrics": s.metrics or None,
                "key_here": key_path(cfg.name, s.name, home).exists(),
                "running_pid": _running(cfg.name, s.name, home) or None} for i, s in enumerate(cfg.servers)]
    out = {"store": cfg.name, "uuid": cfg.uuid, "page_size": cfg.page_size, "devices": devices, "servers": servers,
           "namespaces": cfg.namespaces, "quotas": cfg.quotas, "pin_quotas": cfg.pin_quotas,
           "service": dataclasses.asdict(cfg.service), "worker": dataclasses.asdict(cfg.worker)}
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"store {cfg.name}  uuid {cfg.uuid}  page size {format_size(cfg.page_size)}")
    for e in devices:
        if "error" in e:
            print(f"  device {e['index']}: {e['path']}  ERROR: {e['error']}")
        else:
            areas = ", ".join(f"{x['server'] or '(spare)'}={x['slots']}{' DENIED' if x['denied'] else ''}"
                              for x in e["areas"])
            mark = "" if e["belongs"] else "  (belongs to ANOTHER store)"
            print(f"  device {e['index']}: {e['path']}  {format_size(e['size'])}, slots per area: {areas}{mark}")
    for s in servers:
        extra = "".join(f", {k} {s[k]}" for k in ("sync", "events", "metrics") if s[k])
        state = f"running (pid {s['running_pid']})" if s["running_pid"] else "not running"
        if s["denied"]:
            state = "DENIED, " + state
        print(f"  server {s['name']}: {state}{extra}{'' if s['key_here'] else ', no key file on this machine'}")
    for t, ns in cfg.namespaces.items():
        print(f"  tenant {t} shares namespace {ns}")
    return EXIT_OK


def cmd_disconnect(a: argparse.Namespace) -> int:
    home = mass_home()
    cfg = load_store(a.store, home)
    server = _pick_server(cfg, a.server)
    pid = _running(cfg.name, server, home)
    if not pid:
        _err(f"no service of store {cfg.name!r} as server {server!r} runs here")
        return EXIT_NOT_FOUND
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + a.timeout
    while _running(cfg.name, server, home) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(cfg.name, server, home):
        _err(f"service pid {pid} did not stop within {a.timeout} s")
        return EXIT_FAIL
    print(f"stopped the service of store {cfg.name} as server {server} (pid {pid})")
    return EXIT_OK


def cmd_dashboard(a: argparse.Namespace) -> int:
    from .tui.app import DashboardApp
    from .tui.source import LiveSource

    DashboardApp(LiveSource(a.store), interval=a.interval).run()
    return EXIT_OK


def cmd_quickstart(a: argparse.Namespace) -> int:
    from .quickstart import run_quickstart

    return run_quickstart(pages=a.pages, page_size=parse_size(a.page_size, name="--page-size"))


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
    c.add_argument("--server", action="append", required=True, metavar="NAME[=HOST:PORT]",
                   help="allowed server and its sync address (repeat); one area per server per device")
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

    c = ks.add_parser("allow", help="allow a server on a store: give it a spare area and a keypair",
                      description="Assign SERVER a spare area (or give a denied SERVER its area back), create its "
                                  "CurveZMQ keypair, record it on every device's superblock and in the store "
                                  "config, and tell this machine's running services (they re-read the config). "
                                  "Exit 4 when the store has no spare area or SERVER is already allowed.")
    c.add_argument("store")
    c.add_argument("server", metavar="NAME[=HOST:PORT]", help="server name and its sync address")
    c.add_argument("--events", metavar="HOST:PORT", help="where its service publishes vLLM-format KV events")
    c.add_argument("--metrics", metavar="HOST:PORT", help="its Prometheus endpoint")
    c.add_argument("--reuse", metavar="DENIED",
                   help="give NAME the area of the denied server DENIED (and the pages in it) instead of a "
                        "spare area; DENIED must be stopped on every machine first, since two writers of one "
                        "area turn each other's pages into misses")
    c.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for running services here to apply it (default 10)")
    c.set_defaults(fn=cmd_allow)

    c = ks.add_parser("deny", help="cut a server off a store: revoke its key, stop reading its area",
                      description="Mark SERVER denied on every device's superblock and in the store config and "
                                  "delete its key here. Running services drop its pages from their index, stop "
                                  "accepting its connections, and its own service stops. Its area keeps its "
                                  "index; 'allow' gives it back. Exit 4 for the last allowed server.")
    c.add_argument("store")
    c.add_argument("server", metavar="NAME")
    c.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for running services here to apply it (default 10)")
    c.set_defaults(fn=cmd_deny)

    c = ks.add_parser("connect", help="run this server's cache service in the foreground",
                      description="Start the cache service of STORE as this server; Ctrl-C or SIGTERM stops it cleanly.")
    c.add_argument("store")
    c.add_argument("--server", metavar="NAME", help="server name (default: the only server, or the host name)")
    c.add_argument("--daemon", action="store_true",
                   help="run in the background (log and pid file in MASS_HOME/run/STORE/); stop with disconnect")
    c.set_defaults(fn=cmd_connect)

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


if __name__ == "__main__":
    sys.exit(main())
