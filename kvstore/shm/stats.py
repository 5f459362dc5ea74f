"""The stats block: counters, gauges and latency histograms in shared memory.

Layout (docs/FORMAT.md "Stats block"), all little-endian u64::

    word 0            magic  0x4B5653544154 ("KVSTAT")
    word 1            version (1)
    word 2            n_devices
    word 3            reserved
    words 4..         service fields, in ServiceCounters field order (N_SERVICE words)
    then              per device: DeviceCounters fields (N_DEVICE words each)
    then              histograms of HIST_BUCKETS words each: the service's get latency,
                      then per device read latency and write latency

Histogram bucket b counts samples of latency in microseconds with
``floor(log2(us)) == b - 1`` (bucket 0: under 1 us; the last bucket is open).

Each word has exactly one writer (the supervisor for service words and device
``restarts``/``pid``, the device's worker for the rest of its row), so there
are no locks: readers (status, dashboard) may see a word a moment old, never
a torn one (aligned 8-byte stores).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = 0x4B5653544154
VERSION = 1
HEADER_WORDS = 4
HIST_BUCKETS = 32


@dataclass(frozen=True)
class ServiceCounters:
    """Service-wide counters and gauges (the supervisor writes them)."""

    lookups: int = 0
    """lookup() calls answered."""
    lookup_keys: int = 0
    """Keys asked about in lookups."""
    gets: int = 0
    """get() calls answered."""
    hits: int = 0
    """Pages get() returned (validated)."""
    misses: int = 0
    """Keys get() could not return (absent, retired, failed validation or I/O)."""
    puts: int = 0
    """put() calls answered."""
    put_pages: int = 0
    """Pages offered to put()."""
    put_skipped: int = 0
    """Pages not written because the key was already stored."""
    put_dropped: int = 0
    """Pages not written because no slot could be freed or the write failed."""
    pages_written: int = 0
    """Pages written and indexed."""
    bytes_written: int = 0
    """Payload bytes of pages written."""
    pages_read: int = 0
    """Pages read and validated."""
    bytes_read: int = 0
    """Payload bytes of pages read."""
    validation_failures: int = 0
    """Reads whose header or checksum did not match (served as misses, location dropped)."""
    io_errors: int = 0
    """I/O requests that failed (EIO, worker lost, timeout)."""
    evictions: int = 0
    """Own slots retired by CLOCK to make room."""
    worker_restarts: int = 0
    """I/O workers restarted after dying or hanging."""
    clients_connected: int = 0
    """Client connections now (gauge)."""
    clients_total: int = 0
    """Client connections since start."""
    slots_total: int = 0
    """Slots in the whole store, all areas (gauge)."""
    slots_valid: int = 0
    """Slots holding a valid page, all areas (gauge)."""
    own_slots: int = 0
    """Slots in this server's areas (gauge)."""
    own_slots_valid: int = 0
    """This server's slots holding a valid page (gauge)."""
    pins: int = 0
    """Slots pinned by reads in flight (gauge)."""
    sync_records_sent: int = 0
    """Location updates sent to peers (deltas and answers; the sync agent writes it)."""
    sync_records_received: int = 0
    """Peers' location updates accepted after validation (sync agent)."""
    sync_messages_rejected: int = 0
    """Peer messages dropped: malformed, truncated, out of range or about another owner (sync agent)."""
    sync_requests_sent: int = 0
    """Anti-entropy requests sent to peers (sync agent)."""
    sync_records_merged: int = 0
    """Peers' updates that changed the slot table (supervisor)."""
    sync_answers_served: int = 0
    """Anti-entropy requests answered (supervisor)."""
    sync_snapshots_served: int = 0
    """Answers that had to be a snapshot (supervisor)."""
    sync_restarts: int = 0
    """Sync agent restarts (supervisor)."""
    hints_received: int = 0
    """Hit hints from peers (slots of ours they read), which keep those pages from early eviction."""
    config_generation: int = 0
    """Membership generation (superblocks, bumped by allow/deny) the service runs with (gauge)."""
    config_reloads: int = 0
    """Membership changes (allow/deny) applied while running."""
    areas_dropped: int = 0
    """Valid pages forgotten because their server was denied."""
    salts_changed: int = 0
    """Client connections given their tenant's new salt (an administrator's ``invalidate``)."""
    started_ns: int = 0
    """Service start time, ns since the epoch."""
    heartbeat_ns: int = 0
    """Last time the supervisor loop ran, ns since the epoch (staleness = hung service)."""
    requests_rejected: int = 0
    """Client requests refused as malformed (bad descriptor, sequence, op, count or buffer ids)."""
    requests_cancelled: int = 0
    """Client requests answered as cancelled (the client had timed out)."""
    handshakes_dropped: int = 0
    """Connections dropped during the hello: too slow, too large, malformed or too many at once."""
    direct_refused: int = 0
    """Direct-read records the I/O workers refused: a key that is not the slot's, fields out of
    range, an impossible ring tail (nothing is read for them)."""
    clients_refused: int = 0
    """Clients disconnected for writing what no honest client writes (a refused direct-read
    record, an impossible request-ring tail)."""


@dataclass(frozen=True)
class DeviceCounters:
    """One device's I/O counters (its worker writes them, except restarts and pid)."""

    reads: int = 0
    """Reads completed."""
    writes: int = 0
    """Writes completed."""
    read_bytes: int = 0
    """Bytes read."""
    write_bytes: int = 0
    """Bytes written."""
    read_errors: int = 0
    """Reads that failed or were short."""
    write_errors: int = 0
    """Writes that failed or were short."""
    reads_inflight: int = 0
    """Reads submitted to the device and not completed (gauge)."""
    writes_inflight: int = 0
    """Writes submitted to the device and not completed (gauge; <= max_inflight_writes)."""
    reads_queued: int = 0
    """Reads waiting in the worker's read ring (gauge)."""
    writes_queued: int = 0
    """Writes waiting in the worker's write ring (gauge)."""
    restarts: int = 0
    """Times this device's worker was restarted."""
    pid: int = 0
    """Worker process id."""
    own_slots: int = 0
    """Slots of this server's area on this device (gauge; the supervisor writes it)."""
    own_slots_valid: int = 0
    """Of those, slots holding a valid page (gauge, refreshed every second)."""
    oldest_io_ns: int = 0
    """Submit time (CLOCK_MONOTONIC ns) of the oldest I/O outstanding on the device; 0 when none.
    The supervisor judges the worker's health by it."""
    loop_ns: int = 0
    """Last turn of the worker's loop (CLOCK_MONOTONIC ns)."""


SERVICE_FIELDS = [f.name for f in dataclasses.fields(ServiceCounters)]
DEVICE_FIELDS = [f.name for f in dataclasses.fields(DeviceCounters)]
N_SERVICE = len(SERVICE_FIELDS)
N_DEVICE = len(DEVICE_FIELDS)
S = {n: i for i, n in enumerate(SERVICE_FIELDS)}
D = {n: i for i, n in enumerate(DEVICE_FIELDS)}


@dataclass(frozen=True)
class Histogram:
    """Latency histogram: ``buckets[b]`` counts samples with ``floor(log2(us)) == b - 1``."""

    buckets: tuple[int, ...]

    @property
    def count(self) -> int:
        """Samples recorded."""
        return sum(self.buckets)

    def percentile(self, q: float) -> float:
        """Upper bound in seconds of the bucket holding the ``q``-th percentile (0 if empty)."""
        total = self.count
        if total == 0:
            return 0.0
        rank = math.ceil(total * q / 100.0)
        acc = 0
        for b, c in enumerate(self.buckets):
            acc += c
            if acc >= rank:
                return float(2 ** b) * 1e-6
        return float(2 ** (len(self.buckets) - 1)) * 1e-6


@dataclass(frozen=True)
class StoreStatistics:
    """Everything the stats block holds, as read at one moment."""

    service: ServiceCounters
    """Service-wide counters."""
    devices: tuple[DeviceCounters, ...]
    """Per-device counters, by device index."""
    get_latency: Histogram
    """Client-visible get() latency, measured by the supervisor."""
    read_latency: tuple[Histogram, ...]
    """Per-device read latency (submit to completion)."""
    write_latency: tuple[Histogram, ...]
    """Per-device write latency (submit to completion)."""


def stats_nbytes(n_devices: int) -> int:
    """Bytes of a stats block for ``n_devices`` devices."""
    words = HEADER_WORDS + N_SERVICE + n_devices * N_DEVICE + (1 + 2 * n_devices) * HIST_BUCKETS
    return words * 8


def bucket_of(seconds: float) -> int:
    """Histogram bucket of a latency."""
    us = int(seconds * 1e6)
    return min(HIST_BUCKETS - 1, us.bit_length())


class StatsBlock:
    """Typed access to a stats block in ``buf``. Writers use the arrays directly."""

    def __init__(self, buf: Any, n_devices: int, *, init: bool) -> None:
        self.n_devices = n_devices
        w = np.frombuffer(buf, dtype="<u8", count=stats_nbytes(n_devices) // 8)
        if init:
            w[:] = 0
            w[0], w[1], w[2] = MAGIC, VERSION, n_devices
        elif w[0] != MAGIC or w[1] != VERSION or int(w[2]) != n_devices:
            raise ValueError("not a kvstore stats block of this layout")
        o = HEADER_WORDS
        self.service = w[o:o + N_SERVICE]
        o += N_SERVICE
        self.device = w[o:o + n_devices * N_DEVICE].reshape(n_devices, N_DEVICE)
        o += n_devices * N_DEVICE
        self.hist = w[o:].reshape(1 + 2 * n_devices, HIST_BUCKETS)

    @classmethod
    def attach(cls, buf: Any) -> StatsBlock:
        """Read the device count from the header and attach."""
        hdr = np.frombuffer(buf, dtype="<u8", count=HEADER_WORDS)
        return cls(buf, int(hdr[2]), init=False)

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to service counter ``name`` (supervisor only)."""
        self.service[S[name]] += n

    def set(self, name: str, value: int) -> None:
        """Set service gauge ``name`` (supervisor only)."""
        self.service[S[name]] = value

    def dev_add(self, device: int, name: str, n: int = 1) -> None:
        """Add to a device counter (that device's worker only)."""
        self.device[device, D[name]] += n

    def dev_set(self, device: int, name: str, value: int) -> None:
        """Set a device gauge."""
        self.device[device, D[name]] = value

    def observe(self, hist: int, seconds: float) -> None:
        """Record a latency sample in histogram row ``hist`` (0: get; 1+2d: read d; 2+2d: write d)."""
        self.hist[hist, bucket_of(seconds)] += 1

    def snapshot(self) -> StoreStatistics:
        """Copy everything out into frozen records."""
        sv = [int(x) for x in self.service]
        dv = self.device.copy()
        h = self.hist.copy()
        n = self.n_devices
        return StoreStatistics(
            service=ServiceCounters(*sv),
            devices=tuple(DeviceCounters(*[int(x) for x in dv[d]]) for d in range(n)),
            get_latency=Histogram(tuple(int(x) for x in h[0])),
            read_latency=tuple(Histogram(tuple(int(x) for x in h[1 + 2 * d])) for d in range(n)),
            write_latency=tuple(Histogram(tuple(int(x) for x in h[2 + 2 * d])) for d in range(n)),
        )
