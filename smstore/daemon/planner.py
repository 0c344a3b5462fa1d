"""The daemon's residency planner: what the ranks hold, what is loaded or released for them, and the one budget.

Everything held is a piece: a rank's windowed sampler `hold`s the whole shards of its window and
the next, a block sampler record ranges of them, a reader what it reads that no sampler holds;
the planner merges the holds of every connection into one order, plans the loads that fit, releases what no rank holds any
more, and keeps what a dead predecessor loaded for the ranks (unclaimed) until they claim it or
move past it. It alone decides what fits under ``--shm-limit``: :meth:`Planner.used` is the one
count of the budget (segments in whole pages, as /dev/shm counts them, plus released segments the
loader thread has not removed yet or a process of the owner still maps), and with the loads in
flight (shards' and block pieces' alike, :meth:`Planner.load_started`) it decides every admission:
loads, shares and holds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from smstore import _core
from smstore.daemon.segments import SHM_DIR, CachePart, Segment, SegmentTable, pages
from smstore.daemon.sources import NO_IDENTITY, FileIdentity, Index, Source
from smstore.errors import StoreError
from smstore.format.manifest import Manifest, absolute, manifest_file, read_manifest
from smstore.wire.protocol import BAD_REQUEST, LOAD_FAILED, NO_ROOM, NOT_FOUND, Location, Piece, ProtocolError

__all__ = [
    "CACHED",
    "FETCH_BACKOFF",
    "MAX_FETCH_BACKOFF",
    "MAX_MANIFESTS",
    "Backoff",
    "Held",
    "Loading",
    "ManifestPending",
    "Plan",
    "Planner",
]

# Manifests kept parsed (one per dataset a job holds shards of; more only from a hostile client).
MAX_MANIFESTS = 64
# Seconds before an object whose fetch failed is fetched again for a hold (``--fetch-backoff``),
# doubled at each failure in a row up to MAX_FETCH_BACKOFF.
FETCH_BACKOFF = 30.0
MAX_FETCH_BACKOFF = 600.0


class ManifestPending(Exception):
    """A request names a manifest in object storage that the daemon has not fetched yet."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


@dataclass
class Failure:
    """One row of the failures table: a location whose load failed.

    ``held``: (the checksum a hold expected, the file's identity then, why), while a hold's load of
    it stays failed; ``last``: why the latest load of it failed (any load, until one succeeds);
    ``wait``/``until``: its backoff (an object is fetched again for a hold only after it);
    ``unloaded``: the owner unloaded it while held (a row of a held piece's label: not loaded
    again while a hold names it).
    """

    held: tuple[str | None, FileIdentity | None, str] | None = None
    last: str | None = None
    wait: float = 0.0
    until: float = 0.0
    failed_before: bool = False
    unloaded: bool = False


class Backoff:
    """The failures table, with when an object whose fetch failed may be fetched again: `first`
    seconds after its first failure, doubled at each failure in a row up to `longest`; forgotten
    once a fetch succeeds.

    Args:
        first: Seconds after a first failure (0: at once).
        longest: The longest wait.
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, first: float, longest: float = MAX_FETCH_BACKOFF, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.first, self.longest, self.clock = first, longest, clock
        self.rows: dict[str, Failure] = {}  # by location (a whole shard's load: its path or URL too)

    def failed(self, key: str) -> float:
        """`key` failed (again): the seconds before it may be tried again."""
        row = self.rows.setdefault(key, Failure())
        wait = min(self.longest, max(self.first, 2 * row.wait)) if row.failed_before else self.first
        row.wait, row.until, row.failed_before = wait, self.clock() + wait, True
        return wait

    def due(self, key: str) -> bool:
        """Whether `key` may be tried again (True if it never failed)."""
        row = self.rows.get(key)
        return row is None or not row.failed_before or self.clock() >= row.until

    def succeeded(self, key: str) -> None:
        """A load of `key` succeeded: its backoff and its failures are forgotten."""
        self.rows.pop(key, None)

    def held_failure(self, key: str) -> tuple[str | None, FileIdentity | None, str] | None:
        row = self.rows.get(key)
        return None if row is None else row.held

    def hold_failed(self, key: str, checksum: str | None, identity: FileIdentity | None, why: str) -> None:
        """A held load of `key` failed: refused to the holds until it changes (`clear_held`)."""
        self.rows.setdefault(key, Failure()).held = (checksum, identity, why)

    def clear_held(self, key: str) -> None:
        """A held load of `key` may be tried again (its backoff is remembered)."""
        row = self.rows.get(key)
        if row is not None:
            row.held = None
            self._drop_if_empty(key, row)

    def load_failed(self, key: str, why: str) -> None:
        self.rows.setdefault(key, Failure()).last = why

    def last_failure(self, key: str) -> str | None:
        row = self.rows.get(key)
        return None if row is None else row.last

    def load_done(self, key: str) -> None:
        row = self.rows.get(key)
        if row is not None:
            row.last = None
            self._drop_if_empty(key, row)

    def held_failures(self) -> list[tuple[str, str | None, str]]:
        """(location, checksum, why) of every held load that stays failed (for status)."""
        return [(k, r.held[0], r.held[2]) for k, r in self.rows.items() if r.held is not None]

    def unload(self, key: str) -> None:
        """The owner unloaded the held piece `key` (its label): not loaded while a hold names it."""
        self.rows.setdefault(key, Failure()).unloaded = True

    def unloaded(self, key: str) -> bool:
        row = self.rows.get(key)
        return row is not None and row.unloaded

    def held_again(self, wanted: Collection[str]) -> None:
        """Unloaded pieces no hold names now (not in `wanted`, labels) are loaded again once one does."""
        for key, row in list(self.rows.items()):
            if row.unloaded and key not in wanted:
                row.unloaded = False
                self._drop_if_empty(key, row)

    def _drop_if_empty(self, key: str, row: Failure) -> None:
        if row.held is None and row.last is None and not row.failed_before and not row.unloaded:
            del self.rows[key]


def check_url(url: str) -> None:
    """Refuse a URL off the allow-list (the message names it, never a credential).

    Raises:
        ProtocolError: A scheme smstore does not fetch, or a malformed URL.
    """
    from smstore.remote.urls import parse_url

    try:
        parse_url(url)
    except StoreError as e:
        raise ProtocolError(BAD_REQUEST, str(e)[:1000]) from None


@dataclass(frozen=True)
class Held:
    """A piece a connection holds: what loads and logs call it, its segment's name, its shard's source."""

    label: str
    key: str
    source: Source
    piece: Piece
    reader: bool = False  # a reader's hold for itself, apart from a sampler's (see `Planner.holds`)
    # Which of the connection's holders holds it: a process shares one connection among its
    # samplers' residencies and readers, each replacing only its own holds.
    holder: int = 0


# What a segment is marked with (`Segment.mark`).
MANAGED = "managed"  # loaded for holds: released when no connection holds it
UNCLAIMED = "unclaimed"  # adopted from a dead predecessor that loaded it for holds, not held since
CACHED = "cached"  # a part of a node cache of decoded samples (smstore/daemon/caches.py)


@dataclass
class Loading:
    """A load under way: its pages (taken when queued), whether a plan queued it for the holds,
    and the connections waiting for its reply."""

    pages: int
    for_hold: bool
    waiters: list[int] = field(default_factory=list)


@dataclass
class _Released:
    """A released segment whose pages are still memory: until the loader thread has removed it
    (`present`) and every connection of the owner that mapped it has unmapped it (`pinning`)."""

    checksum: str
    pages: int
    pinning: set[int]
    present: bool = True


@dataclass
class Plan:
    """What a change of the holds asks of the daemon: loads to queue, and what was released (for the log)."""

    loads: list[tuple[Held, int]] = field(default_factory=list)  # (piece, its size), in order
    released: list[str] = field(default_factory=list)  # descriptions of the released segments
    indexes: list[Source] = field(default_factory=list)  # objects whose index to read (their pieces wait)


class Planner:
    """Holds, releases, unclaimed segments and the budget (see the module docstring).

    Args:
        segments: The daemon's segment table (read here; segments leave it through `release`).
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
        shm_limit_from: Where ``shm_limit`` came from, for the messages that refuse a load.
        is_owner: Whether a connection is one of the owner's (only those pin a released segment).
        release: Takes a released segment out of the table and frees it (off the event loop).
        evicted: Frees a part of an idle decoded cache now, out of the table (and counts it).
        fetch_backoff: Seconds before a shard in object storage whose fetch failed is fetched
            again for a hold (doubled at each failure in a row, up to ten minutes).
    """

    def __init__(
        self,
        segments: SegmentTable,
        *,
        shm_limit: int,
        shm_limit_from: str,
        is_owner: Callable[[int], bool],
        release: Callable[[Segment], None],
        fetch_backoff: float = FETCH_BACKOFF,
        evicted: Callable[[Segment], None] = lambda _seg: None,
    ) -> None:
        self.segments = segments
        self._evicted = evicted
        self.shm_limit = shm_limit
        self.shm_limit_from = shm_limit_from
        self._is_owner = is_owner
        self._release = release
        # What each connection holds, in the order to load it: whole shards, or record ranges of
        # them (a block sampler's), alike. A rank's sampler holds its window and the next; a
        # reader holds for itself (``Held.reader``) a shard, or a piece, in object storage no
        # sampler held when it read it: loaded after every sampler's, released first when a
        # sampler's piece needs room, and never listed to the readers that follow the holds
        # ('held'), whose windows it is not part of.
        self.holds: dict[int, list[Held]] = {}
        # Each segment's mark (`Segment.mark`): loaded for holds (MANAGED), or adopted from a dead
        # predecessor that had loaded it for holds and not held again since (UNCLAIMED: kept for
        # the ranks to claim, released when the holds need their room or release a window). A held
        # piece the owner unloaded is a row of the failures table (not loaded while a hold names it).
        # Released segments by name, counted against --shm-limit until the loader thread has
        # removed them and every reader of the owner that mapped them has detached or disconnected:
        # counted free at once, a released piece's room was loaded into while it was still memory.
        self.released: dict[str, _Released] = {}
        self.released_pages = 0  # their total, read by the loader thread too
        # Parsed manifests by the path a hold names, with the file's identity when it was read,
        # and their shards' sources (each decided once, here).
        self.manifests: dict[str, tuple[FileIdentity, Manifest, list[Source]]] = {}
        # The one failures table, by location, with its backoff: held shards whose load (of the
        # whole, or of a piece) failed are not loaded again (and a hold naming them is refused)
        # until the file changes, or for an object, until a hold after its backoff; and why the
        # latest load of a file failed (a reader, or `--require`, hears it).
        self.failures = Backoff(fetch_backoff)
        # Held whole shards that wait for room under --shm-limit (a reader asking for one waits
        # too), as the latest plan found them.
        self.waiting_room: frozenset[str] = frozenset()
        # The loads under way (a shard's, or a piece's) by label, and their pages' sum: one count
        # for both kinds, or each admitted its loads beside the other's. A plan runs at every
        # finished load, and sizing every queued load there again (a stat each) made loading N
        # queued files O(N**2).
        self.loading: dict[str, Loading] = {}
        self.loading_total = 0
        # What the latest plan found the holds to need beside the decoded caches (`holds_reserve`).
        self.holds_waiting = 0
        self.held_largest = 0

    # ---- the budget -----------------------------------------------------------------------------

    def used(self) -> int:
        """Bytes of the budget in use: segments in whole pages, and released segments still memory."""
        return self.segments.pages + self.released_pages

    def committed(self) -> int:
        """Bytes of the budget in use or promised: `used` and every load in flight (shards' and pieces')."""
        return self.used() + self.loading_total

    def room(self) -> int | None:
        """Bytes left under --shm-limit (None: no limit)."""
        return max(0, self.shm_limit - self.used()) if self.shm_limit else None

    def fits(self, size: int, used: int | None = None) -> bool:
        """Whether a blob of `size` bytes fits the budget, with `used` bytes of it in use (default:
        now, loads in flight included)."""
        if not self.shm_limit:
            return True
        return (self.committed() if used is None else used) + pages(size) <= self.shm_limit

    def _too_large(self, label: str, size: int, piece: Piece) -> str:
        what, cure = (
            ("a shard", "pack smaller shards") if piece.whole else ("a block piece", "use smaller blocks")
        )
        return (
            f"{label}: {what} of {size} bytes does not fit the daemon's --shm-limit of "
            f"{self.shm_limit} bytes; raise the limit or {cure}"
        )

    # ---- holds ----------------------------------------------------------------------------------

    def hold(
        self, cid: int, named: Location, pieces: list[Piece], *, reader: bool = False, holder: int = 0
    ) -> list[Held]:
        """Replace what `holder` on connection `cid` holds (as a sampler, or with `reader` for itself) with
        `pieces` of a manifest (whole shards or record ranges, in the order to load them); what it holds now.

        Raises:
            ProtocolError: The manifest, a shard index or a range is bad, a piece is larger than
                the whole budget, or a shard's load failed or it changed since its manifest was
                written (every rank holding it hears so at its next hold).
        """
        manifest_path = named.name
        try:
            manifest, sources = self._manifest(named)
        except StoreError as e:
            raise ProtocolError(BAD_REQUEST, str(e)[:1000]) from None
        if any(p.shard >= len(manifest.shards) for p in pieces):
            raise ProtocolError(BAD_REQUEST, f"{manifest_path} has {len(manifest.shards)} shards")
        for p in pieces:
            if not p.whole and p.stop > manifest.shards[p.shard].records:
                raise ProtocolError(
                    BAD_REQUEST, f"{manifest_path}: no records {p.first}-{p.end} in shard {p.shard}"
                )
        held = [
            Held(sources[p.shard].label(p), sources[p.shard].key(p), sources[p.shard], p, reader, holder)
            for p in pieces
        ]
        for h in held:
            source = h.source
            failure = self.failures.held_failure(source.location)
            if source.remote and failure is not None and self.failures.due(source.location):
                # Its backoff is over: this hold fetches it again (its index afresh: it may have been uploaded again).
                self.failures.clear_held(source.location)
                source.index = None
            if not h.piece.whole and source.remote and source.index is None and not source.indexing:
                check_url(source.location)  # the allow-list, before its index read is queued
            if not h.piece.whole and not source.remote and self.failed(source) is None:
                try:
                    source.check()  # a range is located by its shard's index: checked against the manifest now
                except OSError as e:
                    raise ProtocolError(LOAD_FAILED, f"{source.location}: {e.strerror}") from None
                except StoreError as e:
                    self.failures.hold_failed(
                        source.location, source.checksum, source.identity(), str(e)[:1000]
                    )
            if self.shm_limit:
                if h.piece.whole:
                    try:
                        size: int | None = source.current_size()
                    except OSError as e:
                        raise ProtocolError(NOT_FOUND, f"{source.location}: {e.strerror}") from None
                else:
                    size = source.piece_size(h.piece)  # None: an object's index not read yet
                if size is not None and not self.fits(size, used=0):
                    raise ProtocolError(NO_ROOM, self._too_large(h.label, size, h.piece))
            why = self.failed(source)
            if why is not None:
                what = "shard" if h.piece.whole else "block"
                raise ProtocolError(LOAD_FAILED, f"a held {what} cannot be loaded: {why}"[:1000])
        kept = [h for h in self.holds.get(cid, ()) if (h.reader, h.holder) != (reader, holder)]
        if kept or held:
            self.holds[cid] = kept + held
        else:
            self.holds.pop(cid, None)
        return held

    def wanted(self, *, readers: bool = True, whole: bool = False) -> dict[str, Held]:
        """Segment name -> piece of every held piece, in priority order (each sampler's order,
        merged; then, with `readers`, what readers hold for themselves); with `whole`, whole shards only."""
        wanted: dict[str, Held] = {}
        for for_reader in (False, True) if readers else (False,):
            lists = [
                [h for h in hs if h.reader == for_reader and h.holder == k]
                for hs in self.holds.values()
                for k in dict.fromkeys(h.holder for h in hs)
            ]
            for depth in range(max((len(h) for h in lists), default=0)):
                for held in lists:
                    if depth < len(held) and (not whole or held[depth].piece.whole):
                        wanted.setdefault(held[depth].key, held[depth])
        return wanted

    def marked(self, mark: str) -> list[str]:
        """The keys of the segments marked `mark` (MANAGED or UNCLAIMED)."""
        return [key for key, seg in self.segments.items() if seg.mark == mark]

    def plan(self, loading: Collection[str] | None = None) -> Plan:
        """Release the held segments no connection holds any more; plan the loads of held pieces that fit.

        `loading`: the labels of the loads under way (counted in the budget, not queued again;
        default: those `load_started` was told of).
        """
        if loading is None:
            loading = self.loading
        plan = Plan()
        wanted = self.wanted()
        samplers = self.wanted(readers=False)
        for key in self.marked(UNCLAIMED):
            if key in wanted:
                self.segments[key].mark = MANAGED  # held again: the holds manage it from now on
        self.failures.held_again({h.label for h in wanted.values()})
        plan.released = [
            self.release(self.segments[ck])
            for ck in self.marked(MANAGED)
            if ck not in wanted and ck in self.segments
        ]
        if plan.released:
            # The holds moved past a window: what a dead predecessor held that no rank claimed
            # since belongs to a window behind it.
            plan.released += [self.release(self.segments[ck]) for ck in self.marked(UNCLAIMED)]
        # A load under way fills its pages whatever the holds say now (one for a hold that moved
        # on, or one that the pieces before it in the holders' order would now leave no room
        # for): it counts until it lands.
        used = self.committed()
        waiting: list[str] = []
        full = False
        self.holds_waiting, self.held_largest = 0, 0
        idle: list[Segment] | None = None  # the idle caches' parts, listed once if room is short
        for key, h in wanted.items():
            if key in self.segments:
                self.held_largest = max(self.held_largest, pages(self.segments[key].size))
                continue
            if self.failures.unloaded(h.label) or self.failed(h.source):
                continue
            if h.label in loading:
                continue  # on its way, and counted above
            size = h.source.piece_size(h.piece)
            if size is None:
                if h.piece.whole:
                    continue  # the load would fail: the reader falls back to (and reports) the file
                if h.source.remote and not h.source.indexing:
                    h.source.indexing = True
                    plan.indexes.append(h.source)
                full = True  # an object's index not read yet: later pieces wait for this one's
                continue
            if not self.fits(size, used=0):  # an object's piece, sized once its index was read
                why = self._too_large(h.label, size, h.piece)
                self.failures.hold_failed(h.source.location, h.source.checksum, NO_IDENTITY, why)
                continue
            self.held_largest = max(self.held_largest, pages(size))
            coming = 0  # pages released here that are room once the loader thread removes them
            while not full and not self.fits(size, used - coming):
                # Room for a held piece comes first: the oldest unclaimed adopted segment goes,
                # then (for a sampler's piece) the oldest that only readers hold for themselves.
                if unclaimed := self.marked(UNCLAIMED):
                    seg = min((self.segments[ck] for ck in unclaimed), key=lambda s: s.loaded_at)
                elif key in samplers and (spare := self._readers_only(samplers)):
                    seg = min(spare, key=lambda s: s.loaded_at)
                    self._drop_reader_holds(seg.checksum)
                elif idle or (idle is None and (idle := self.idle_cache_parts())):
                    # Then the decoded caches no process uses any more: no one maps them, so
                    # they are freed now (a chunk of a few MiB), and their room is room at once.
                    part = idle.pop(0)
                    plan.released.append(self.evict(part))
                    used -= pages(part.size)
                    continue
                else:
                    break
                plan.released.append(self.release(seg))
                if not self.released[seg.name].pinning:
                    coming += pages(seg.size)
            # Released pages are room only once removed (`freed`): the next plan loads it then.
            if full or not self.fits(size, used):
                full = True  # later pieces wait until earlier ones are released
                if h.piece.whole:
                    # A reader asking for it waits for it (a piece's reader reads its file meanwhile:
                    # the room it waits for may be its own mapping of a released piece).
                    waiting.append(h.label)
                self.holds_waiting += pages(size)  # room no decoded cache may take
                continue
            used += pages(size)
            plan.loads.append((h, size))
        self.waiting_room = frozenset(waiting)
        return plan

    # ---- decoded caches: parts budgeted here, beside the holds -----------------------------------

    def idle_cache_parts(self, keep: str | None = None) -> list[Segment]:
        """The parts of the decoded caches no process uses (none maps its meta page), but `keep`'s,
        in the order to evict them: the oldest cache first, its chunks before its meta page."""
        idle: dict[str, float] = {}  # cache -> when its meta page was made
        parts: list[tuple[CachePart, Segment]] = []
        for seg in self.segments.values():
            if seg.cache is not None and seg.cache.cache != keep:
                parts.append((seg.cache, seg))
                if seg.cache.chunk < 0 and not seg.clients:
                    idle[seg.cache.cache] = seg.loaded_at
        parts = [(part, seg) for part, seg in parts if part.cache in idle]
        parts.sort(key=lambda ps: (idle[ps[0].cache], ps[0].chunk < 0, ps[1].loaded_at))
        return [seg for _part, seg in parts]

    def evict(self, seg: Segment) -> str:
        """Free a part of an idle decoded cache now (no process maps it); what the log calls it."""
        assert seg.cache is not None
        self._evicted(seg)  # counted, and out of the table
        return f"decoded cache {seg.cache.cache[:12]} part {seg.cache.chunk}"

    def holds_reserve(self) -> int:
        """Bytes a decoded cache leaves free for the holds (as the latest plan found them): what
        their pieces waiting for room need, and the largest held piece once more, so that a window
        can move on to one as large while the caches keep their room."""
        return self.holds_waiting + self.held_largest

    def cache_fits(self, size: int, cache: str) -> bool:
        """Whether a part of `size` bytes of cache `cache` fits: beside every load in flight and the
        room the holds keep (`holds_reserve`), after evicting idle caches' parts (not `cache`'s)
        if that makes room."""
        if self.shm_limit:
            room, used = self.shm_limit - self.holds_reserve(), self.committed()
        else:
            # No budget: the caches take at most half of /dev/shm's free room, the rest is the
            # blobs' (a memfd is not in /dev/shm: its pages are counted here, not in its free room).
            available, _total = _core.shm_space(os.fspath(SHM_DIR))
            used = self.segments.cache_pages
            room = (available + used) // 2
        return self.evict_idle(used + pages(size) - room, keep=cache)

    def make_room(self, size: int) -> None:
        """Evict idle caches if `size` more bytes fit the budget only without them (an owner's load
        or share: a plan makes room for the holds itself)."""
        if self.shm_limit:
            self.evict_idle(self.committed() + pages(size) - self.shm_limit)

    def evict_idle(self, need: int, *, keep: str | None = None) -> bool:
        """Free `need` bytes by evicting idle caches' parts (not `keep`'s), the oldest cache first;
        none if evicting them all would not free that much. Whether `need` bytes are free now."""
        if need <= 0:
            return True
        idle = self.idle_cache_parts(keep)
        if sum(pages(s.size) for s in idle) < need:
            return False  # keep them: evicting them would not make the room
        for seg in idle:
            if need <= 0:
                break
            need -= pages(seg.size)
            self.evict(seg)
        return True

    def evict_oldest_idle_cache(self) -> None:
        """Evict the oldest idle cache whole (the daemon serves as many caches as it may)."""
        parts = self.idle_cache_parts()  # the oldest cache's first
        oldest = {seg.cache.cache for seg in parts[:1] if seg.cache is not None}
        for seg in parts:
            if seg.cache is not None and seg.cache.cache in oldest:
                self.evict(seg)

    def _readers_only(self, samplers: dict[str, Held]) -> list[Segment]:
        """The resident segments that only readers hold for themselves (no sampler holds them)."""
        held = {h.key for holds in self.holds.values() for h in holds if h.reader}
        return [self.segments[ck] for ck in held - samplers.keys() if ck in self.segments]

    def _drop_reader_holds(self, checksum: str) -> None:
        """Readers no longer hold `checksum` for themselves (released for a sampler's room: they
        map it, and one that reads it again after unmapping it holds it again)."""
        for cid, held in list(self.holds.items()):
            kept = [h for h in held if not (h.reader and h.key == checksum)]
            if kept:
                self.holds[cid] = kept
            else:
                del self.holds[cid]

    def stale(self, keys: list[str]) -> list[str]:
        """Of the pieces a reader maps, those no connection holds any more (it should unmap them)."""
        held = {h.key for hs in self.holds.values() for h in hs}
        return [key for key in keys if key and key not in held]

    def release(self, seg: Segment) -> str:
        """Stop serving a held segment no rank holds; its pages count until every owner's reader unmaps it."""
        self.dropped(seg.checksum)
        # Only the owner's processes pin a released segment's pages in the budget: a group member
        # who keeps a segment mapped must never stall the owner's loads (docs/daemon.md, "Groups").
        pinning = {c for c in seg.clients if self._is_owner(c)}
        self.released[seg.name] = _Released(seg.checksum, pages(seg.size), pinning)
        self.released_pages += pages(seg.size)
        self._release(seg)
        return f"{', '.join(seg.paths)} ({seg.checksum})"

    def unmapped(self, cid: int, checksum: str | None = None) -> bool:
        """Connection `cid` no longer maps `checksum` (None: any); True if a released segment's pages are free now."""
        free = False
        for name, entry in list(self.released.items()):
            if (checksum is None or entry.checksum == checksum) and cid in entry.pinning:
                entry.pinning.discard(cid)
                free = self._forget_if_free(name) or free
        return free

    def mapped_released(self) -> list[str]:
        """The checksums of the released segments a reader of the owner still maps, sorted."""
        return sorted({entry.checksum for entry in self.released.values() if entry.pinning})

    def freed(self, name: str) -> bool:
        """The loader thread removed the released segment `name` (its name, the daemon's mapping);
        True if its pages are free now."""
        entry = self.released.get(name)
        if entry is None:
            return False
        entry.present = False
        return self._forget_if_free(name)

    def _forget_if_free(self, name: str) -> bool:
        entry = self.released[name]
        if entry.present or entry.pinning:
            return False
        del self.released[name]
        self.released_pages -= entry.pages
        return True

    def disconnect(self, cid: int) -> bool:
        """Connection `cid` closed: its holds, mappings and waits go. True if the holds must be planned again."""
        freed = [self.unmapped(cid)]
        for entry in self.loading.values():
            if cid in entry.waiters:
                entry.waiters.remove(cid)
        return self.holds.pop(cid, None) is not None or any(freed)

    # ---- segments coming and going --------------------------------------------------------------

    def adopted(self, checksum: str) -> None:
        """A segment adopted from a dead predecessor was loaded for its ranks' holds."""
        self.segments[checksum].mark = UNCLAIMED

    def is_held(self, checksum: str) -> bool:
        """Whether a segment was loaded because a rank held it (a successor releases it once they move on)."""
        seg = self.segments.get(checksum)
        return seg is not None and seg.mark in (MANAGED, UNCLAIMED)

    def dropped(self, checksum: str) -> None:
        """A segment left the table (unloaded, replaced, stopping, released): its mark goes with it."""
        seg = self.segments.get(checksum)
        if seg is not None:
            seg.mark = None

    def unload(self, checksum: str) -> None:
        """The owner unloaded `checksum`: not loaded again for the holds naming it now."""
        held = self.wanted().get(checksum)
        if held is not None:
            self.failures.unload(held.label)

    def load_started(self, label: str, size: int | None = None, *, for_hold: bool = False) -> Loading:
        """A load of `label` (a file, or a piece of `size` bytes) is queued: its pages count in the
        budget until it lands (`load_done`/`load_failed`); `for_hold`: a plan queued it for the holds."""
        entry = self.loading.get(label)
        if entry is not None:
            return entry
        footprint = 0
        with contextlib.suppress(OSError):  # no size: the load fails, and counts nothing meanwhile
            footprint = pages(os.stat(label).st_size if size is None else size)
        entry = self.loading[label] = Loading(footprint, for_hold)
        self.loading_total += footprint
        return entry

    def _load_ended(self, label: str) -> bool:
        """Its pages leave the count of loads in flight; whether a plan queued it for the holds."""
        entry = self.loading.pop(label, None)
        if entry is None:
            return False
        self.loading_total -= entry.pages
        return entry.for_hold

    def load_failed(self, label: str, why: str, source: Source | None = None) -> None:
        """A load of `label` failed: if a rank holds it, its shard is not loaded again until the
        file changes (for an object, until a hold after its backoff)."""
        for_hold = self._load_ended(label)
        self.failures.load_failed(label, why)
        held = next((h for h in self.wanted().values() if h.label == label), None)
        if held is not None:
            source = held.source  # the checksum a hold expects of it
        if source is not None and source.checksum is not None and (for_hold or held is not None):
            self.failures.hold_failed(source.location, source.checksum, source.identity(), why)
            if source.remote:
                self.failures.failed(source.location)

    def load_done(self, label: str, key: str, *, asked: bool, source: Source | None = None) -> bool:
        """A load of `label` gave segment `key` (before the table has it); `asked`: a client waits
        for it. True if the holds manage it (`manage` it once it is in the table).

        Held now, or loaded for a hold that moved on while it loaded (and asked for by no one
        else): the holds manage it, and the next plan drops it if none holds it.
        """
        for_hold = self._load_ended(label)
        self.failures.load_done(label)
        if source is not None:
            self.failures.succeeded(source.location)
        fresh = key not in self.segments
        return any(h.label == label for held in self.holds.values() for h in held) or (
            for_hold and fresh and not asked
        )

    @staticmethod
    def manage(seg: Segment) -> None:
        """The holds manage `seg` (`load_done` said so): released when no connection holds it."""
        seg.mark = MANAGED

    def indexed(self, source: Source, index: object) -> None:
        """The read of an object's index ended: its pieces can be sized now, or they failed (why)."""
        source.indexing = False
        if isinstance(index, Index):
            source.index = index
        else:  # its read failed (an exception), or gave no index
            self.failures.hold_failed(source.location, source.checksum, NO_IDENTITY, f"{index}"[:1000])
            self.failures.failed(source.location)

    # ---- questions readers ask ------------------------------------------------------------------

    def on_its_way(self, label: str, key: str) -> bool:
        """Whether the held piece `label` (segment `key`) is loading, or held and waiting for room."""
        if label in self.loading:
            return True
        held = self.wanted().get(key) if label in self.waiting_room else None
        return held is not None and held.label == label

    def why_not_held(self, label: str, key: str) -> str | None:
        """Why a held piece is not served (its load failed, or the owner unloaded it), if it is one."""
        if self.failures.unloaded(label):
            return f"{label} was unloaded ('smstore unload') while held"
        held = next((h for hl in self.holds.values() for h in hl if h.label == label), None)
        if held is not None:
            return self.failed(held.source)
        # Held by no one now: a whole shard's failure while its file is the one that failed, or a
        # piece's shard's (a reader asking for a piece of it reads the file, or hears why not).
        location, piece, _range = label.partition("#records=")
        entry = self.failures.held_failure(location)
        if entry is None:
            return None
        return self.failed(Source(location, entry[0] if piece else key))

    def last_failure(self, label: str) -> str | None:
        """Why the latest load of `label` failed, if it did (until one succeeds)."""
        return self.failures.last_failure(label)

    def failed(self, source: Source) -> str | None:
        """Why the held load of `source` failed, while it is still the shard that failed."""
        entry = self.failures.held_failure(source.location)
        if entry is None:
            return None
        held, identity, why = entry
        if held == source.checksum and identity is not None and identity == source.identity():
            return why
        self.failures.clear_held(source.location)  # the file changed (or another checksum is held): try again
        return None

    def knows(self, named: Location) -> bool:
        """Whether a hold named the manifest `named` (it is kept parsed)."""
        return (manifest_file(named.name) if named.remote else named.name) in self.manifests

    def checksums(self, named: Location) -> frozenset[str]:
        """The checksums of the shards of the manifest `named` (what a reader follows).

        Raises:
            StoreError: The manifest is missing or bad.
        """
        manifest, _sources = self._manifest(named)
        return frozenset(s.checksum for s in manifest.shards)

    def remote_manifest(self, url: str) -> Manifest | None:
        """The manifest fetched from `url` (by :meth:`add_remote`), if it is kept."""
        cached = self.manifests.get(manifest_file(url))
        return cached[1] if cached is not None else None

    def add_remote(self, url: str, manifest: Manifest) -> None:
        """Keep the manifest fetched from `url`: the holds naming it use it from now on, until
        :meth:`forget` (a hold naming another dataset there: it was replaced in the bucket)."""
        self._keep(manifest_file(url), NO_IDENTITY, manifest)

    def forget(self, url: str) -> None:
        self.manifests.pop(manifest_file(url), None)

    @staticmethod
    def _sources(manifest: Manifest) -> list[Source]:
        """Each shard's source, decided here once (a local file or an object)."""
        return [
            Source(absolute(manifest.shard_path(k)), shard.checksum, shard.file_size)
            for k, shard in enumerate(manifest.shards)
        ]

    def _keep(self, path: str, key: FileIdentity, manifest: Manifest) -> list[Source]:
        sources = self._sources(manifest)
        if len(self.manifests) >= MAX_MANIFESTS:
            self.manifests.clear()
        self.manifests[path] = (key, manifest, sources)
        return sources

    def _manifest(self, named: Location) -> tuple[Manifest, list[Source]]:
        """The manifest `named` and its shards' sources, parsed again only if the file changed.

        Every rank holds at every window: parsing a manifest of thousands of shards each time
        would be milliseconds of the daemon's core at each window switch. A manifest in object
        storage is never fetched here (on the event loop): the daemon fetches it on a thread first.

        Raises:
            ManifestPending: `named` is a URL whose manifest was not fetched yet.
            StoreError: The manifest is missing or bad.
        """
        path = named.name
        if named.remote:
            remote = self.manifests.get(manifest_file(path))  # a prefix ending in '/' names its manifest.json
            if remote is None:
                raise ManifestPending(path)
            return remote[1], remote[2]
        try:
            st = os.stat(manifest_file(path))
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None  # read_manifest says what is wrong
        cached = self.manifests.get(path)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1], cached[2]
        manifest = read_manifest(path)
        if key is None:
            return manifest, self._sources(manifest)
        return manifest, self._keep(path, key, manifest)
