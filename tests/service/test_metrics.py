"""The Prometheus endpoint, scraped over HTTP on 127.0.0.1 and parsed with the Prometheus text parser."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import KVCacheClient
from kvstore.quickstart import page_bytes
from kvstore.testing import free_port_pair, make_store, wait_for

pytestmark = pytest.mark.integration
PS = 16 << 10


def scrape(port: int) -> dict[str, Any]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(sample)


def test_metrics_endpoint_reflects_the_service(home: Path, file_devices: Any, services: Any) -> None:
    port = free_port_pair()
    (dev,) = file_devices.make(1, (1 << 20) + 64 * (4096 + PS))
    make_store(home, "m", [dev], PS, metrics={"local": f"127.0.0.1:{port}"})
    services(home, "m")
    keys = [b"k/%d" % i for i in range(10)]
    with KVCacheClient.connect("m", home=home) as c:
        c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        with c.get(keys + [b"absent"]) as v:
            assert v.hits == 10
    lab = {"store": "m", "server": "local"}
    # a get's hits come from the device workers' reports, its misses and latency from the
    # client's counters: both reach the stats within a loop turn or so
    assert wait_for(lambda: value(scrape(port), "kvstore_get_latency_seconds", "kvstore_get_latency_seconds_count",
                                  **lab) == 1 and value(scrape(port), "kvstore_hits", "kvstore_hits_total", **lab) == 10)
    f = scrape(port)
    assert value(f, "kvstore_hits", "kvstore_hits_total", **lab) == 10
    assert value(f, "kvstore_misses", "kvstore_misses_total", **lab) == 1
    assert value(f, "kvstore_written_bytes", "kvstore_written_bytes_total", **lab) == 10 * PS
    assert value(f, "kvstore_device_reads", "kvstore_device_reads_total", device="0", **lab) >= 10
    assert f["kvstore_get_latency_seconds"].type == "histogram"
    assert value(f, "kvstore_get_latency_seconds", "kvstore_get_latency_seconds_count", **lab) == 1
    assert value(f, "kvstore_get_latency_seconds", "kvstore_get_latency_seconds_bucket", le="+Inf", **lab) == 1
    assert f["kvstore_own_slots"].type == "gauge" and value(f, "kvstore_own_slots", "kvstore_own_slots", **lab) == 64


def test_every_metric_is_documented() -> None:
    from kvstore.service.metrics import COUNTERS, DEVICE_COUNTERS, DEVICE_GAUGES, GAUGES

    doc = (Path(__file__).parents[2] / "docs" / "METRICS.md").read_text()
    for table, suffix in ((COUNTERS, "_total"), (DEVICE_COUNTERS, "_total"), (GAUGES, ""), (DEVICE_GAUGES, "")):
        for name, _ in table.values():
            assert f"`kvstore_{name}{suffix}`" in doc, name


@pytest.mark.parametrize("what", ["metrics", "events"])
def test_an_address_held_by_another_socket_fails_the_start_in_one_line(home: Path, file_devices: Any,
                                                                        what: str) -> None:
    """A listening address another socket holds: the service does not start, says which address
    and what to do in one line (no traceback), and leaves no process or shm behind."""
    import socket

    from kvstore.errors import KVStoreError
    from kvstore.testing import ServiceProcess

    port = free_port_pair()
    (dev,) = file_devices.make(1, (1 << 20) + 64 * (4096 + PS))
    make_store(home, "m", [dev], PS, **{what: {"local": f"127.0.0.1:{port}"}})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        svc = ServiceProcess(home, "m")
        with pytest.raises(KVStoreError) as e:
            svc.start()
    log = svc.log.read_text()
    assert f"mass-ctl: error: server local: {what} address 127.0.0.1:{port} cannot be bound: Address already in use" \
        in log and f"--{what} HOST:PORT" in log, str(e.value)[-2000:]
    assert "Traceback" not in log
    assert svc.proc.returncode not in (None, 0)
    assert not svc.leftovers()
    assert wait_for(lambda: not _processes_of(home)), _processes_of(home)  # its workers went with it
    # the saved setting is corrected from the command line: --what '' turns it off, and the start works
    assert f"--{what} ''" in log
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with ServiceProcess(home, "m", args=[f"--{what}", ""]) as svc2:
            assert svc2.proc is not None and svc2.proc.poll() is None
    assert svc2.proc.returncode == 0
    from kvstore.config import load_local

    assert "local" not in load_local("m", home).hosted


def _processes_of(home: Path) -> list[int]:
    """Live (not zombie) processes started with MASS_HOME=home (a service and what it spawned)."""
    mark = f"MASS_HOME={home.resolve()}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0") and \
                    (d / "stat").read_text().split(")")[-1].split()[0] != "Z":
                found.append(int(d.name))
        except OSError:
            continue
    return found
