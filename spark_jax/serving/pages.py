"""The KV page pool (a host free list) and the host copy of the block table.

Pages are indices into the paged cache's first axis. ``PageAllocator`` is plain Python (the
scheduling policy allocates from it); ``BlockTable`` is the numpy table the paged executor
uploads each step, kept in step with the sequences' page lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class PageAllocator:
    """The host-side free list of KV pages (indices into the page pool's first axis)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))[::-1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} pages asked for but {len(self._free)} are free.")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


class Paged(Protocol):
    """What the block table reads of a running sequence."""

    slot: int | None
    pages: list[int]
    num_computed: int
    admitted: int


class BlockTable:
    """Each slot's pages (``num_pages``: no page) and cached length, as the device reads them.

    ``sync`` rewrites only what changed since the last call: rows whose owner changed
    (an admission is told apart by its admission number) or whose page list grew.
    """

    def __init__(self, num_slots: int, max_pages_per_seq: int, num_pages: int):
        self.none = num_pages  # an index past the pool: reads nothing, writes are dropped
        self.pages = np.full((num_slots, max_pages_per_seq), num_pages, np.int32)
        self.lengths = np.zeros((num_slots,), np.int32)
        self._written: dict[int, tuple[int, int]] = {}  # slot -> (admission, pages written)

    def sync(self, running: Iterable[Paged]) -> None:
        """Brings the table to the running sequences' pages and computed lengths."""
        owners = {s.slot: s for s in running if s.slot is not None}
        for slot, (admitted, _) in list(self._written.items()):
            seq = owners.get(slot)
            if seq is None or seq.admitted != admitted:
                self.pages[slot] = self.none
                self.lengths[slot] = 0
                del self._written[slot]
        for slot, seq in owners.items():
            _, written = self._written.get(slot, (seq.admitted, 0))
            if written != len(seq.pages):
                self.pages[slot, written : len(seq.pages)] = seq.pages[written:]
                self._written[slot] = (seq.admitted, len(seq.pages))
            self.lengths[slot] = seq.num_computed
