"""Prometheus text endpoint of one cache service, read from the shared-memory stats block.

A ``prometheus_client`` collector turns each scrape into metric families built
from one snapshot of the stats block (the same numbers ``status --json``
shows); it never touches the data path. Names follow Prometheus conventions
(``kvstore_..._total`` counters, ``_bytes``, ``_seconds`` histograms); every
family carries ``store`` and ``server`` labels, device families a ``device``
label. docs/METRICS.md lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..shm.stats import Histogram, StatsBlock

#: service counter field -> (metric name without prefix, help)
COUNTERS = {
    "lookups": ("lookups", "lookup() calls answered"),
    "lookup_keys": ("lookup_keys", "Keys asked about in lookups"),
    "gets": ("gets", "get() calls answered"),
    "hits": ("hits", "Pages returned by get() (validated)"),
    "misses": ("misses", "Keys get() could not return"),
    "puts": ("puts", "put() calls answered"),
    "put_pages": ("put_pages", "Pages offered to put()"),
    "put_skipped": ("put_skipped_pages", "Pages not written because the key was already stored"),
    "put_dropped": ("put_dropped_pages", "Pages not written: no slot, or the write failed"),
    "pages_written": ("written_pages", "Pages written and indexed"),
    "bytes_written": ("written_bytes", "Payload bytes written"),
    "pages_read": ("read_pages", "Pages read and validated"),
    "bytes_read": ("read_bytes", "Payload bytes read"),
    "validation_failures": ("validation_failures", "Reads that failed header or checksum validation"),
    "io_errors": ("io_errors", "I/O requests that failed"),
    "evictions": ("evictions", "Own slots retired by CLOCK"),
    "worker_restarts": ("worker_restarts", "I/O workers restarted"),
    "clients_total": ("client_connections", "Client connections accepted"),
    "sync_records_sent": ("sync_sent_records", "Location updates sent to peers"),
    "sync_records_received": ("sync_received_records", "Peer location updates accepted"),
    "sync_messages_rejected": ("sync_rejected_messages", "Peer messages dropped as invalid"),
    "sync_requests_sent": ("sync_requests", "Anti-entropy requests sent"),
    "sync_records_merged": ("sync_merged_records", "Peer updates that changed the slot table"),
    "hints_received": ("hints_received", "Hit hints received from peers"),
    "config_reloads": ("config_reloads", "Membership changes (allow/deny) applied while running"),
    "areas_dropped": ("denied_dropped_pages", "Valid pages forgotten because their server was denied"),
    "salts_changed": ("invalidated_connections", "Client connections re-keyed by an invalidate"),
    "requests_rejected": ("rejected_requests", "Client requests refused as malformed"),
    "requests_cancelled": ("cancelled_requests", "Client requests answered as cancelled (the client timed out)"),
    "handshakes_dropped": ("dropped_handshakes", "Connections dropped during the hello (slow, large, malformed)"),
}
GAUGES = {
    "clients_connected": ("clients", "Client connections now"),
    "slots_total": ("slots", "Slots in the whole store"),
    "slots_valid": ("valid_slots", "Slots holding a valid page, all areas"),
    "own_slots": ("own_slots", "Slots in this server's areas"),
    "own_slots_valid": ("own_valid_slots", "This server's slots holding a valid page"),
    "pins": ("reads_in_flight_slots", "Slots with a read in flight"),
    "config_generation": ("config_generation", "Membership generation (of the superblocks) in use"),
}
DEVICE_COUNTERS = {
    "reads": ("device_reads", "Device reads completed"),
    "writes": ("device_writes", "Device writes completed"),
    "read_bytes": ("device_read_bytes", "Bytes read from the device"),
    "write_bytes": ("device_written_bytes", "Bytes written to the device"),
    "read_errors": ("device_read_errors", "Device reads that failed or were short"),
    "write_errors": ("device_write_errors", "Device writes that failed or were short"),
}
DEVICE_GAUGES = {
    "reads_inflight": ("device_reads_inflight", "Reads outstanding in the device"),
    "writes_inflight": ("device_writes_inflight", "Writes outstanding in the device"),
    "reads_queued": ("device_reads_queued", "Reads waiting in the worker's ring"),
    "writes_queued": ("device_writes_queued", "Writes waiting in the worker's ring"),
    "own_slots": ("device_own_slots", "Slots of this server's area on the device"),
    "own_slots_valid": ("device_own_valid_slots", "Of those, slots holding a valid page"),
}


def _hist(name: str, doc: str, labels: list[str], values: list[str], h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    acc = 0
    buckets = []
    for b, c in enumerate(h.buckets[:-1]):
        acc += c
        buckets.append((repr((2 ** b) * 1e-6), acc))  # bucket b: under 2**b microseconds
    buckets.append(("+Inf", acc + h.buckets[-1]))
    # the block keeps no exact sum: report the sum of bucket midpoints (a lower-bound estimate)
    est = sum(c * (2 ** max(b - 1, 0)) * 1.5e-6 for b, c in enumerate(h.buckets))
    fam.add_metric(values, buckets, est)
    return fam


class StatsCollector:
    """Builds metric families from a snapshot of the stats block at every scrape."""

    def __init__(self, stats: StatsBlock, store: str, server: str) -> None:
        self.stats = stats
        self.labels = ["store", "server"]
        self.values = [store, server]

    def collect(self) -> Iterator[Any]:
        snap = self.stats.snapshot()
        sv = snap.service
        for field, (name, doc) in COUNTERS.items():
            c = CounterMetricFamily(f"kvstore_{name}", doc, labels=self.labels)
            c.add_metric(self.values, float(getattr(sv, field)))
            yield c
        for field, (name, doc) in GAUGES.items():
            g = GaugeMetricFamily(f"kvstore_{name}", doc, labels=self.labels)
            g.add_metric(self.values, float(getattr(sv, field)))
            yield g
        dl = [*self.labels, "device"]
        for field, (name, doc) in DEVICE_COUNTERS.items():
            c = CounterMetricFamily(f"kvstore_{name}", doc, labels=dl)
            for d, dev in enumerate(snap.devices):
                c.add_metric([*self.values, str(d)], float(getattr(dev, field)))
            yield c
        for field, (name, doc) in DEVICE_GAUGES.items():
            g = GaugeMetricFamily(f"kvstore_{name}", doc, labels=dl)
            for d, dev in enumerate(snap.devices):
                g.add_metric([*self.values, str(d)], float(getattr(dev, field)))
            yield g
        yield _hist("kvstore_get_latency_seconds", "get() latency in the service", self.labels, self.values,
                    snap.get_latency)
        for kind, hs in (("read", snap.read_latency), ("write", snap.write_latency)):
            for d, h in enumerate(hs):
                yield _hist(f"kvstore_device_{kind}_latency_seconds", f"Device {kind} latency (submit to completion)",
                            dl, [*self.values, str(d)], h)


def serve_metrics(address: str, stats: StatsBlock, store: str, server: str) -> Any:
    """Start the endpoint on ``HOST:PORT`` in a daemon thread; returns the server (``shutdown()``)."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, store, server))
    server_, _thread = start_http_server(int(port), addr=host, registry=registry)
    return server_
