"""`PrefixCache`: full KV pages indexed by the tokens they hold, shared by every sequence whose
context starts with them.

Identity. A page is named by its tokens and by the page before it: the key of page i of a
context is (id of page i-1's entry, the page_size tokens of page i). Entries get ids from a
counter and ids are never reused, so a key names one prefix exactly, with no hash to collide,
and an entry whose parent was evicted can never be reached again (it is evicted in its turn).
Looking up a context walks its full pages from the first: one dictionary lookup per page.
A radix tree over token ids would match inside a page too, but what can be shared is whole
pages (a page is the unit attention reads and the allocator hands out), so the tree's extra
resolution would buy nothing.

Ownership. An entry counts the sequences holding it (`refs`). A sequence holds its shared
prefix and the full pages of its context it publishes at admission, while it prefills them:
those are *pending* until its prefill has written them, and another sequence that reaches a
pending page waits (`Lookup.pending`) rather than computing the same page again. Nobody writes
a page another sequence holds: only full pages are shared, a lookup stops at least one token
short of the context (the last token's logits must come from a prefill; the engine's fork of
a context's copies, engine.py `_fork_waiting`, is the exception: they take the logits of the
prefill that just ended and a copy of its partial page), and a sequence's writes start at its
first unshared page. When a sequence releases its pages, the full pages it
wrote that are not indexed yet are published (the next turn of a conversation, a preempted
sequence coming back), the rest go back to the free list.

Eviction. Entries no sequence holds stay cached, least recently released first out when the
pool needs pages (`allocate`). A sequence releases its pages deepest first, so a page is
always older in that order than its parent and leaves go before their parents.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from etjax.cache.page_allocator import OutOfPagesError, PageAllocator

NO_PARENT = -1  # the parent id of a context's first page


@dataclass(eq=False)
class CachedPage:
    """One indexed page: `page` holds `tokens`, which follow the prefix of entry `parent`."""

    id: int
    page: int
    parent: int
    tokens: tuple[int, ...]
    ready: bool  # its keys and values are written (False while its owner prefills it)
    refs: int = 0  # sequences holding it


@dataclass
class Lookup:
    """What the cache holds of a context: the shared `pages` (ready, in order) and whether the
    next page is still being prefilled by another sequence (`pending`)."""

    pages: list[CachedPage] = field(default_factory=list)
    pending: bool = False

    @property
    def idle(self) -> int:
        """Pages of the match that no sequence holds: taking them removes them from the free
        count (they could have been evicted)."""
        return sum(entry.refs == 0 for entry in self.pages)


class PrefixCache:
    """The page pool: free pages, plus pages indexed by content (module docstring).

    With `enabled=False` nothing is indexed and it is a plain free list."""

    def __init__(self, num_pages: int, page_size: int, enabled: bool = True) -> None:
        self.allocator = PageAllocator(num_pages)
        self.num_pages, self.page_size, self.enabled = num_pages, page_size, enabled
        self._index: dict[tuple[int, tuple[int, ...]], CachedPage] = {}
        self._idle: OrderedDict[int, CachedPage] = OrderedDict()  # by entry id, oldest first
        self._next_id = 0
        self.evictions = 0

    # Counts -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones and cached ones nobody holds."""
        return self.allocator.num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Indexed pages, held or not."""
        return len(self._index)

    @property
    def num_held(self) -> int:
        """Pages sequences hold (the pool minus the null page, free and idle cached pages)."""
        return self.num_pages - 1 - self.num_free

    # Lookup and taking ------------------------------------------------------------------

    def lookup(self, tokens: list[int], max_pages: int) -> Lookup:
        """The longest run of ready indexed pages `tokens` starts with, at most `max_pages`."""
        found = Lookup()
        if not self.enabled:
            return found
        parent, ps = NO_PARENT, self.page_size
        for i in range(min(max_pages, len(tokens) // ps)):
            entry = self._index.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if entry is None:
                break
            if not entry.ready:
                found.pending = True
                break
            found.pages.append(entry)
            parent = entry.id
        return found

    def take(self, entries: list[CachedPage]) -> None:
        """Hold `entries` (a lookup's pages) for a sequence."""
        for entry in entries:
            if entry.refs == 0:
                del self._idle[entry.id]
            entry.refs += 1

    def allocate(self, count: int) -> list[int]:
        """`count` pages for a sequence to write, evicting idle cached pages as needed."""
        if count > self.num_free:
            raise OutOfPagesError(f"need {count} pages, {self.num_free} free or evictable")
        while self.allocator.num_free < count:
            _, entry = self._idle.popitem(last=False)
            del self._index[(entry.parent, entry.tokens)]
            self.allocator.free([entry.page])
            self.evictions += 1
        return self.allocator.allocate(count)

    def free(self, pages: list[int]) -> None:
        """Return pages that were never indexed to the free list."""
        self.allocator.free(pages)

    def publish(
        self, held: list[CachedPage], pages: list[int], tokens: list[int]
    ) -> list[CachedPage]:
        """Index the pages a sequence is about to prefill, as pending entries it holds.

        held: the sequence's shared prefix (pages[:len(held)] are theirs); pages: all of its
        pages; tokens: its context. Every full page of the context after the prefix is
        published, up to the first one another sequence already indexed. Returns `held` and
        the new entries: what the sequence holds, in page order."""
        out = list(held)
        if not self.enabled:
            return out
        ps = self.page_size
        parent = held[-1].id if held else NO_PARENT
        for i in range(len(held), len(tokens) // ps):
            key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
            if key in self._index:
                break
            entry = self._new_entry(pages[i], key, ready=False)
            entry.refs = 1
            out.append(entry)
            parent = entry.id
        return out

    def mark_written(self, held: list[CachedPage], written: int) -> None:
        """The holder's prefill has written its first `written` tokens: pages within are ready."""
        for i, entry in enumerate(held):
            if not entry.ready and (i + 1) * self.page_size <= written:
                entry.ready = True

    def release(
        self, held: list[CachedPage], pages: list[int], tokens: list[int], written: int
    ) -> None:
        """A sequence gives back its pages.

        held: the entries it holds (its first pages); pages: all of its pages; tokens: its
        prompt and generated tokens; written: how many of them its pages hold. Its pending
        entries are dropped (their pages were never finished), its other full written pages
        are published, idle from now on; everything else returns to the free list."""
        ps = self.page_size
        chain: list[CachedPage] = []  # entries along its context, to be marked recent
        free: list[int] = []
        parent: CachedPage | None = None
        broken = False  # a page of the context that is not indexed: nothing after it can be
        for i, page in enumerate(pages):
            if i < len(held):
                entry = held[i]
                entry.refs -= 1
                if not entry.ready:
                    # A pending page is held by its owner alone: nobody waits on it any more.
                    del self._index[(entry.parent, entry.tokens)]
                    free.append(page)
                    broken = True
                    continue
                chain.append(entry)
                parent = entry
                continue
            full = (i + 1) * ps <= written
            if not self.enabled or broken or not full:
                free.append(page)
                broken = True
                continue
            key = (NO_PARENT if parent is None else parent.id, tuple(tokens[i * ps : (i + 1) * ps]))
            known = self._index.get(key)
            if known is None:
                known = self._new_entry(page, key, ready=True)
            else:
                free.append(page)  # another sequence wrote the same page first: keep one
                if not known.ready:
                    broken = True
                    continue
            chain.append(known)
            parent = known
        # Deepest first: a parent is then more recent than its children and outlives them.
        for entry in reversed(chain):
            if entry.refs == 0:
                self._idle.pop(entry.id, None)
                self._idle[entry.id] = entry
        self.allocator.free(free)

    def _new_entry(self, page: int, key: tuple[int, tuple[int, ...]], ready: bool) -> CachedPage:
        entry = CachedPage(self._next_id, page, key[0], key[1], ready)
        self._next_id += 1
        self._index[key] = entry
        return entry

    def check(self, holders: list[list[CachedPage]]) -> None:
        """Assert the bookkeeping adds up (tests): every page is free, idle or held, once;
        each entry's refs is the number of `holders` (the live sequences' held lists) that
        hold it."""
        counts: dict[int, int] = {}
        for held in holders:
            for entry in held:
                counts[entry.id] = counts.get(entry.id, 0) + 1
        for entry in self._index.values():
            assert entry.refs == counts.get(entry.id, 0), (entry, counts.get(entry.id, 0))
            assert (entry.refs == 0) == (entry.id in self._idle), entry
        indexed = [entry.page for entry in self._index.values()]
        free = self.allocator.free_pages
        assert len(set(indexed)) == len(indexed), "a page indexed twice"
        assert not set(indexed) & set(free), "an indexed page on the free list"
        assert len(set(free)) == len(free), "a page freed twice"
