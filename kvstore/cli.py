"""mass-ctl: the administrator's and GPU server's command line.

    mass-ctl kvcache create STORE --device PATH... --page-size SIZE --server NAME[=HOST:PORT]...
    mass-ctl kvcache connect STORE [--server NAME]
    mass-ctl kvcache connect STORE [--server NAME] --daemon / disconnect STORE [--server NAME]
    mass-ctl kvcache status STORE [--server NAME] [--json] [--watch]
    mass-ctl kvcache list / show STORE [--json]
    mass-ctl kvcache quickstart

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 3 store not
found, 4 refused (not allowed, already running, device mismatch).
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
from .config import (ServerConfig, StoreConfig, check_name, check_page_size, load_store, mass_home,
                     run_dir, save_store, store_path)
from .errors import AlreadyRunning, DeviceMismatch, KVStoreError, NotAllowed, StoreNotFound

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4


def _err(msg: str) -> None:
    print(f"mass-ctl: error: {msg}", file=sys.stderr)


def cmd_create(a: argparse.Namespace) -> int:
    from .storage.device import format_device

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
    for d in a.device:
        if not os.path.exists(d):
            if a.device_size is None:
                _err(f"device {d} does not exist; pass --device-size SIZE to create it as a plain file")
                return EXIT_USAGE
            with open(d, "wb") as f:
                f.truncate(parse_size(a.device_size, name="--device-size"))
    for i, d in enumerate(a.device):
        sb = format_device(d, store_uuid=cfg.uuid_bytes, store_name=cfg.name, page_size=page_size,
                           device_index=i, device_count=len(a.device), servers=[s.name for s in servers],
                           force=a.force)
        per = sb.areas[0].slot_count
        print(f"formatted {d}: {len(sb.areas)} area(s) of {per} slots ({format_size(per * page_size)} each)")
    p = save_store(cfg, home)
    print(f"created store {cfg.name} ({cfg.uuid}), page size {format_size(page_size)}; config {p}")
    if len(servers) > 1:
        print(f"server keys are in {home / 'keys' / cfg.name}: copy each server's .key file and the config "
              "to that server's MASS_HOME")
    return EXIT_OK


def _pick_server(cfg: StoreConfig, name: str | None) -> str:
    if name:
        cfg.server_index(name)
        return name
    if len(cfg.servers) == 1:
        return cfg.servers[0].name
    host = socket.gethostname().split(".")[0].lower()
    if any(s.name == host for s in cfg.servers):
        return host
    raise NotAllowed(f"store {cfg.name!r} has servers {[s.name for s in cfg.servers]}: pass --server NAME")


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
    configure_logging()
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
    from .shm.segment import Segment, name_prefix, pid_alive
    from .shm.board import Board
    from .shm.stats import StatsBlock

    home = mass_home()
    cfg = load_store(a.store, home)
    servers = [a.server] if a.server else [s.name for s in cfg.servers]
    out: dict[str, Any] = {"store": cfg.name, "uuid": cfg.uuid, "page_size": cfg.page_size,
                           "devices": list(cfg.devices), "servers": {}}
    for name in servers:
        cfg.server_index(name)
        pidf = run_dir(cfg.name, home) / f"{name}.pid"
        pid = int(pidf.read_text()) if pidf.exists() else 0
        entry: dict[str, Any] = {"running": bool(pid and pid_alive(pid)), "pid": pid or None}
        if entry["running"]:
            try:
                seg = Segment.attach(name_prefix(home, cfg.name, name) + "stats")
                st = StatsBlock.attach(seg.buf).snapshot()
                entry["stats"] = dataclasses.asdict(st)
                del st
                board = Segment.attach(name_prefix(home, cfg.name, name) + "board")
                entry["tenants"] = (Board(board.buf).read() or {}).get("tenants", {})
            except Exception as exc:  # a service between start and ready
                entry["stats_error"] = str(exc)
        out["servers"][name] = entry
    if a.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"store {cfg.name}  uuid {cfg.uuid}  page size {format_size(cfg.page_size)}")
    for i, d in enumerate(cfg.devices):
        print(f"  device {i}: {d}")
    for name, srv in out["servers"].items():
        if not srv["running"]:
            print(f"server {name}: not running")
            continue
        sv = srv.get("stats", {}).get("service", {})
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
                    "servers": [s.name for s in cfg.servers],
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
        names = ", ".join(n + ("*" if n in r["running"] else "") for n in r["servers"])
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
                      "areas": [{"server": x.server, "slots": x.slot_count} for x in sb.areas]})
        except KVStoreError as err:
            e["error"] = str(err)
        devices.append(e)
    servers = [{"name": s.name, "sync": s.sync or None, "events": s.events or None, "metrics": s.metrics or None,
                "key_here": (home / "keys" / cfg.name / f"{s.name}.key").exists(),
                "running_pid": _running(cfg.name, s.name, home) or None} for s in cfg.servers]
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
            areas = ", ".join(f"{x['server']}={x['slots']}" for x in e["areas"])
            mark = "" if e["belongs"] else "  (belongs to ANOTHER store)"
            print(f"  device {e['index']}: {e['path']}  {format_size(e['size'])}, slots per area: {areas}{mark}")
    for s in servers:
        extra = "".join(f", {k} {s[k]}" for k in ("sync", "events", "metrics") if s[k])
        state = f"running (pid {s['running_pid']})" if s["running_pid"] else "not running"
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
    p = argparse.ArgumentParser(prog="mass-ctl", description="Manage kvstore KV-cache stores.")
    sub = p.add_subparsers(dest="group", required=True)
    kv = sub.add_parser("kvcache", help="shared KV-cache page stores")
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
    c.set_defaults(fn=cmd_create)

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
