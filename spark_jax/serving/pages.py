"""The KV page pool (a host free list with reference counts and a prefix cache) and the host
copy of the block table.

Pages are indices into the paged cache's first axis. ``PageAllocator`` is plain Python (the
scheduling policy allocates from it); ``BlockTable`` is the numpy table the paged executor
uploads each step, kept in step with the sequences' page lists.

Prefix caching (vLLM's automatic prefix caching): a full page whose keys were computed is
registered under its ``page_keys`` entry, a hash of every token up to the page's end and of the
adapter that computed it (a chain: each key hashes its parent's). A sequence admitted later
whose tokens start with the same pages takes references on them instead of computing them.
Pages are reference-counted; a cached page nobody holds stays cached, and the least recently
released of those is evicted (its key forgotten) when a fresh page is wanted and none is free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


def page_keys(
    parent: bytes | None, tokens: Sequence[int], page_size: int, salt: str | None
) -> list[bytes]:
    """The prefix-cache keys of the pages of ``tokens``, one a ``page_size`` tokens: each
    hashes its page's tokens and the key of the page before it (``parent`` for the first;
    None: a sequence's first page, which hashes ``salt`` instead, the adapter's name: the
    keys an adapter computes are its own). The tokens become bytes once, for all pages."""
    data = memoryview(np.asarray(tokens, np.int64).tobytes())
    step = page_size * 8  # int64 bytes
    keys = []
    for start in range(0, len(data), step):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent if parent is not None else f"first:{salt}".encode())
        h.update(data[start : start + step])
        parent = h.digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """The host-side pool of KV pages (indices into the page pool's first axis).

    A page is free, held (reference count >= 1), or cached and idle: registered under a key,
    held by nobody, evictable. ``num_free`` counts free and evictable pages: what
    ``allocate`` can hand out.
    """

    def __init__(self, num_pages: int, enable_prefix_caching: bool = False):
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_pages))[::-1]
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # cached page -> its key
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        self.queries = 0  # pages looked up in the prefix cache
        self.hits = 0  # of those, pages found

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def in_use(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (held or idle)."""
        return len(self._key_of)

    @property
    def hit_rate(self) -> float:
        """The fraction of looked-up pages the prefix cache had (0 before any lookup)."""
        return self.hits / self.queries if self.queries else 0.0

    def references(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, one reference each; evicts idle cached pages when none is free."""
        if n > self.num_free:
            raise RuntimeError(f"{n} pages asked for but {self.num_free} are free.")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference on each page; a page nobody holds is free again, or idle in
        the cache if it is registered."""
        for page in pages:
            assert self._refs[page] > 0, f"page {page} freed more often than it was held"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    # -- the prefix cache --------------------------------------------------------------------

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of ``keys`` from the first (no references
        taken: see ``acquire``)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def idle_among(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` are idle (acquiring them lowers ``num_free`` by as many)."""
        return sum(page in self._idle for page in pages)

    def acquire(self, pages: Sequence[int], looked_up: int) -> None:
        """Takes a reference on each of ``pages`` (cached pages found for ``looked_up`` keys)."""
        self.queries += looked_up
        self.hits += len(pages)
        for page in pages:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1

    def register(self, page: int, key: bytes) -> None:
        """Records that ``page`` (held, full, its keys computed) holds the prefix ``key``.
        A key already cached keeps its page: this one stays private and is freed as usual."""
        if not self.enable_prefix_caching or key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (vLLM's ``reset_prefix_cache``): idle cached pages are
        free again and held ones stay with their holders, private from now on. The books
        stay balanced while requests run. Returns how many keys were forgotten."""
        forgotten = len(self._key_of)
        self._free.extend(reversed(self._idle))  # the oldest released handed out first
        self._idle.clear()
        self._key_of.clear()
        self._page_of.clear()
        return forgotten

    def check(self) -> None:
        """Asserts the pool's books balance (tests): every page is free, idle or held."""
        free, idle = set(self._free), set(self._idle)
        held = {p for p in range(self.num_pages) if self._refs[p] > 0}
        assert len(free) == len(self._free) and not (free & idle) and not (free & held)
        assert not (idle & held) and len(free) + len(idle) + len(held) == self.num_pages
        assert idle <= set(self._key_of) and not (free & set(self._key_of))
        assert all(self._page_of[k] == p for p, k in self._key_of.items())


class Paged(Protocol):
    """What the block table reads of a running sequence."""

    slot: int | None
    pages: list[int]
    num_computed: int
    admitted: int


class BlockTable:
    """Each slot's pages (``num_pages``: no page) and cached length, as the device reads them.

    ``sync`` rewrites only what changed since the last call: rows whose owner changed
    (an admission is told apart by its admission number) or whose page list changed, from
    its first changed entry on (a speculative row gives back its rejected drafts' pages and
    may take others for its next drafts before the next sync, so the count alone cannot
    tell: entries it no longer owns must read ``none`` again, or the row's keys would land
    in a page another row now owns).
    """

    def __init__(self, num_slots: int, max_pages_per_seq: int, num_pages: int):
        self.none = num_pages  # an index past the pool: reads nothing, writes are dropped
        self.pages = np.full((num_slots, max_pages_per_seq), num_pages, np.int32)
        self.lengths = np.zeros((num_slots,), np.int32)
        self._written: dict[int, tuple[int, list[int]]] = {}  # slot -> (admission, pages)

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
            _, written = self._written.get(slot, (seq.admitted, []))
            if written != seq.pages:
                same = _common_prefix(written, seq.pages)
                self.pages[slot, same : len(written)] = self.none  # no longer owned
                self.pages[slot, same : len(seq.pages)] = seq.pages[same:]
                self._written[slot] = (seq.admitted, list(seq.pages))
            self.lengths[slot] = seq.num_computed


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one list grew or shrank at its end
        return n
    return next(i for i in range(n) if a[i] != b[i])
