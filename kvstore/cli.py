"""mass-ctl: the administrator's and GPU server's command line.

    mass-ctl kvcache create STORE --device PATH... --page-size SIZE --server NAME[=HOST:PORT]...
    mass-ctl kvcache connect STORE [--server NAME]
    mass-ctl kvcache status STORE [--server NAME] [--json]
    mass-ctl kvcache quickstart

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 3 store not
found, 4 refused (not allowed, already running, device mismatch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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

    configure_logging()
    cfg = load_store(a.store)
    server = _pick_server(cfg, a.server)
    serve(cfg, server)
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
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
    c.set_defaults(fn=cmd_connect)

    c = ks.add_parser("status", help="show a store and its services' statistics")
    c.add_argument("store")
    c.add_argument("--server", metavar="NAME")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(fn=cmd_status)

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
