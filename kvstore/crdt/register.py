"""Per-slot location registers: the unit of replication.

For every (device, area, slot) a register ``(generation, digest, length,
state)``. Only the area's owner writes it. The join of two registers is the
greater in ``(generation, state, digest, length)`` order, compared
lexicographically:

* generations only grow for a slot (the owner's generation source), and every
  tombstone (RETIRED) takes a new generation, so "newer generation wins";
* within one generation an owner writes at most one register per state, and
  a slot that a reader found corrupt is marked RETIRED locally at the same
  generation so that a re-delivered VALID copy of the same write cannot bring
  it back (the owner's next write, with a higher generation, does).

* the digest and length only break ties an honest owner never produces (two
  different registers with one generation and state: a confused or forged
  owner); ordering by them keeps replicas from settling on whichever copy
  arrived first.

A total order makes the join commutative, associative and idempotent, so
duplicated, reordered or lost-and-resent deltas converge (tests/crdt).

Wire record (``REGISTER_DTYPE``, 56 bytes, little-endian; docs/FORMAT.md)::

    off size field
      0    2  device   u16
      2    2  area     u16
      4    4  slot     u32
      8    8  gen      u64
     16   32  digest   d0..d3, u64 each
     48    4  length   u32
     52    1  state    u8 (2 VALID, 3 RETIRED)
     53    3  pad
"""

from __future__ import annotations

import numpy as np

from ..shm.slots import RETIRED, VALID

REGISTER_DTYPE = np.dtype([
    ("device", "<u2"), ("area", "<u2"), ("slot", "<u4"), ("gen", "<u8"),
    ("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"),
    ("length", "<u4"), ("state", "u1"), ("pad", "V3"),
])
assert REGISTER_DTYPE.itemsize == 56

#: states a register may carry on the wire
WIRE_STATES = (VALID, RETIRED)
