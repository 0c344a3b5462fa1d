"""The daemon's residency planner: what the ranks hold, what is loaded or released for them, and the one budget.

A rank's windowed sampler `hold`s the shards of its window and the next; the planner merges the
holds of every rank into one order, plans the loads that fit, releases what no rank holds any
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
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass, field

from smstore._manifest import Manifest, absolute, manifest_file, read_manifest
from smstore._protocol import BAD_REQUEST, LOAD_FAILED, NO_ROOM, NOT_FOUND, ProtocolError
from smstore.daemon.segments import Segment, SegmentTable, pages
from smstore.errors import StoreError
from smstore.remote.urls import is_remote_url

__all__ = [
    "FETCH_BACKOFF",
    "MAX_FETCH_BACKOFF",
    "MAX_MANIFESTS",
    "Backoff",
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


class Backoff:
    """When an object whose fetch failed may be fetched again: `first` seconds after its first
    failure, doubled at each failure in a row up to `longest`; forgotten once a fetch succeeds.

    Args:
        first: Seconds after a first failure (0: at once).
        longest: The longest wait.
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, first: float, longest: float = MAX_FETCH_BACKOFF, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.first, self.longest, self.clock = first, longest, clock
        self._entries: dict[str, tuple[float, float]] = {}  # key -> (its last wait, when it ends)

    def failed(self, key: str) -> float:
        """`key` failed (again): the seconds before it may be tried again."""
        last = self._entries.get(key)
        wait = self.first if last is None else min(self.longest, max(self.first, 2 * last[0]))
        self._entries[key] = (wait, self.clock() + wait)
        return wait

    def due(self, key: str) -> bool:
        """Whether `key` may be tried again (True if it never failed)."""
        entry = self._entries.get(key)
        return entry is None or self.clock() >= entry[1]

    def succeeded(self, key: str) -> None:
        self._entries.pop(key, None)


# A file's identity as stat sees it: a failed held load is retried only once this changes.
FileIdentity = tuple[int, int, int, int]


def _identity(path: str) -> FileIdentity | None:
    if is_remote_url(path):
        return (
            0,
            0,
            0,
            0,
        )  # an object has no identity to watch: a failed fetch is tried again after `Backoff`
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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

    loads: list[tuple[str, str]] = field(default_factory=list)  # (path, checksum), in order
    released: list[str] = field(default_factory=list)  # descriptions of the released segments


class Planner:
    """Holds, releases, unclaimed segments and the budget (see the module docstring).

    Args:
        segments: The daemon's segment table (read here; segments leave it through `release`).
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
        shm_limit_from: Where ``shm_limit`` came from, for the messages that refuse a load.
        is_owner: Whether a connection is one of the owner's (only those pin a released segment).
        release: Takes a released segment out of the table and frees it (off the event loop).
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
    ) -> None:
        self.segments = segments
        # When objects whose fetch failed (shards, blocks' shards) are fetched again for a hold.
        self.backoff = Backoff(fetch_backoff)
        self.shm_limit = shm_limit
        self.shm_limit_from = shm_limit_from
        self._is_owner = is_owner
        self._release = release
        # What each connection (a rank's sampler) holds, in the order to load it.
        self.holds: dict[int, list[tuple[str, str]]] = {}
        # What a reader holds for itself (a shard in object storage no sampler held when it read
        # it; the last one it read so): loaded after every sampler's shards, released first when a
        # sampler's shard needs room, and never listed to the readers that follow the holds
        # ('held'), whose windows it is not part of.
        self.reader_holds: dict[int, list[tuple[str, str]]] = {}
        # Segments loaded for holds (dropped when no connection holds them).
        self.managed: set[str] = set()
        # Adopted segments a dead predecessor had loaded for holds, not held again since: kept for
        # the ranks to claim when they hold again, released when the holds need their room or
        # release a window (the job has moved past them).
        self.unclaimed: set[str] = set()
        self.hold_loads: dict[str, str] = {}  # paths being loaded because a rank held them -> checksum
        # Released segments by name, counted against --shm-limit until the loader thread has
        # removed them and every reader of the owner that mapped them has detached or disconnected:
        # counted free at once, a released piece's room was loaded into while it was still memory.
        self.released: dict[str, _Released] = {}
        self.released_pages = 0  # their total, read by the loader thread too
        # Parsed manifests by the path a hold names, with the file's identity when it was read.
        self.manifests: dict[str, tuple[FileIdentity, Manifest, list[str]]] = {}
        # Shards named by URL: their sizes, as their manifests say (there is no file to stat).
        self.remote_sizes: dict[str, int] = {}
        # Held paths whose load failed: path -> (the checksum held, the file's identity then, why).
        # Not loaded again (and a hold naming them is refused) until the file changes, or for an
        # object, until a hold after its backoff.
        self.hold_failed: dict[str, tuple[str, FileIdentity | None, str]] = {}
        # Held checksums the owner unloaded: not loaded again while a hold still names them.
        self.unloaded: set[str] = set()
        # Held paths that wait for room under --shm-limit (a reader asking for one waits too).
        self.waiting_room: set[str] = set()
        # The pages of each load under way (a shard's, or a block piece's), taken when it was
        # queued, and their sum: one count for both, or each admitted its loads beside the other's.
        # A plan runs at every finished load, and sizing every queued load there again (a stat
        # each) made loading N queued files O(N**2): 5,000 one-record shards took minutes.
        self.loading_pages: dict[str, int] = {}
        self.loading_total = 0

    # ---- the budget -----------------------------------------------------------------------------

    def used(self) -> int:
        """Bytes of the budget in use: segments in whole pages, and released segments still memory."""
        return self.segments.pages + self.released_pages

    def committed(self) -> int:
        """Bytes of the budget in use or promised: `used` and every load in flight (shards' and pieces')."""
        return self.used() + self.loading_total

    def size(self, path: str) -> int:
        """A held shard's size: its manifest's word for a URL, else the file's (OSError if it has none)."""
        remote = self.remote_sizes.get(path)
        return remote if remote is not None else os.stat(path).st_size

    def room(self) -> int | None:
        """Bytes left under --shm-limit (None: no limit)."""
        return max(0, self.shm_limit - self.used()) if self.shm_limit else None

    def fits(self, size: int, used: int | None = None) -> bool:
        """Whether a blob of `size` bytes fits the budget, with `used` bytes of it in use (default:
        now, loads in flight included)."""
        if not self.shm_limit:
            return True
        return (self.committed() if used is None else used) + pages(size) <= self.shm_limit

    # ---- holds ----------------------------------------------------------------------------------

    def hold(
        self, cid: int, manifest_path: str, indices: list[int], *, reader: bool = False
    ) -> list[tuple[str, str]]:
        """Replace what connection `cid` holds with shards `indices` of a manifest; the (path, checksum) held.

        `reader`: a reader's hold for itself (see ``reader_holds``), apart from a sampler's.

        Raises:
            ProtocolError: The manifest or an index is bad, a shard is larger than the whole
                budget, or a shard's load failed (every rank holding it hears so at its next hold).
        """
        try:
            manifest, paths = self._manifest(manifest_path)
        except StoreError as e:
            raise ProtocolError(BAD_REQUEST, str(e)[:1000]) from None
        if any(k >= len(manifest.shards) for k in indices):
            raise ProtocolError(BAD_REQUEST, f"{manifest_path} has {len(manifest.shards)} shards")
        shards = [(paths[k], manifest.shards[k].checksum) for k in indices]
        if self.shm_limit:
            for path, _checksum in shards:
                try:
                    size = self.size(path)
                except OSError as e:
                    raise ProtocolError(NOT_FOUND, f"{path}: {e.strerror}") from None
                if not self.fits(size, used=0):
                    msg = (
                        f"{path}: a shard of {size} bytes does not fit the daemon's --shm-limit of "
                        f"{self.shm_limit} bytes; raise the limit or pack smaller shards"
                    )
                    raise ProtocolError(NO_ROOM, msg)
        for path, checksum in shards:
            if is_remote_url(path) and path in self.hold_failed and self.backoff.due(path):
                del self.hold_failed[path]  # its backoff is over: this hold fetches it again
            why = self.failed(path, checksum)
            if why is not None:
                raise ProtocolError(LOAD_FAILED, f"a held shard cannot be loaded: {why}")
        holds = self.reader_holds if reader else self.holds
        if shards:
            holds[cid] = shards
        else:
            holds.pop(cid, None)
        return shards

    def wanted(self, *, readers: bool = True) -> dict[str, str]:
        """Checksum -> path of every held shard, in priority order (each sampler's order, merged;
        then, with `readers`, what readers hold for themselves)."""
        wanted: dict[str, str] = {}
        for holds in (self.holds, self.reader_holds) if readers else (self.holds,):
            lists = list(holds.values())
            for depth in range(max((len(h) for h in lists), default=0)):
                for held in lists:
                    if depth < len(held):
                        path, checksum = held[depth]
                        wanted.setdefault(checksum, path)
        return wanted

    def plan(self, loading: Collection[str]) -> Plan:
        """Release the held segments no connection holds any more; plan the loads of held shards that fit.

        `loading`: the paths being loaded now (counted in the budget, not queued again).
        """
        plan = Plan()
        wanted = self.wanted()
        samplers = self.wanted(readers=False)
        claimed = self.unclaimed & wanted.keys()  # held again: the holds manage them from now on
        self.unloaded &= wanted.keys()  # unloaded shards are loaded again once a hold names them anew
        self.unclaimed -= claimed
        self.managed |= claimed
        plan.released = [self.release(self.segments[ck]) for ck in self.managed - wanted.keys()]
        if plan.released:
            # The holds moved past a window: what a dead predecessor held that no rank claimed
            # since belongs to a window behind it.
            plan.released += [self.release(self.segments[ck]) for ck in list(self.unclaimed)]
        # A load under way fills its pages whatever the holds say now (one for a hold that moved
        # on, or one that the shards before it in the holders' order would now leave no room
        # for): it counts until it lands.
        used = self.committed()
        self.waiting_room = set()
        full = False
        for checksum, path in wanted.items():
            if checksum in self.segments or checksum in self.unloaded or self.failed(path, checksum):
                continue
            if path in loading:
                continue  # on its way, and counted above
            try:
                size = self.size(path)
            except OSError:
                continue  # the load would fail: the reader falls back to (and reports) the file
            coming = 0  # pages released here that are room once the loader thread removes them
            while not full and not self.fits(size, used - coming):
                # Room for a held shard comes first: the oldest unclaimed adopted segment goes,
                # then (for a sampler's shard) the oldest that only readers hold for themselves.
                if self.unclaimed:
                    seg = min((self.segments[ck] for ck in self.unclaimed), key=lambda s: s.loaded_at)
                elif checksum in samplers and (spare := self._readers_only(samplers)):
                    seg = min(spare, key=lambda s: s.loaded_at)
                    self._drop_reader_holds(seg.checksum)
                else:
                    break
                plan.released.append(self.release(seg))
                if not self.released[seg.name].pinning:
                    coming += pages(seg.size)
            # Released pages are room only once removed (`freed`): the next plan loads it then.
            if full or not self.fits(size, used):
                full = True  # later shards wait until earlier ones are released
                self.waiting_room.add(path)
                continue
            used += pages(size)
            self.hold_loads[path] = checksum
            plan.loads.append((path, checksum))
        return plan

    def _readers_only(self, samplers: dict[str, str]) -> list[Segment]:
        """The resident segments that only readers hold for themselves (no sampler holds them)."""
        held = {ck for holds in self.reader_holds.values() for _p, ck in holds}
        return [self.segments[ck] for ck in held - samplers.keys() if ck in self.segments]

    def _drop_reader_holds(self, checksum: str) -> None:
        """Readers no longer hold `checksum` for themselves (released for a sampler's room: they
        map it, and one that reads it again after unmapping it holds it again)."""
        for cid, held in list(self.reader_holds.items()):
            kept = [(p, c) for p, c in held if c != checksum]
            if kept:
                self.reader_holds[cid] = kept
            else:
                del self.reader_holds[cid]

    def release(self, seg: Segment) -> str:
        """Stop serving a held segment no rank holds; its pages count until every owner's reader unmaps it."""
        self.managed.discard(seg.checksum)
        self.unclaimed.discard(seg.checksum)
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
        """Connection `cid` closed: its holds and mappings go. True if the holds must be planned again."""
        freed = [self.unmapped(cid)]
        held = self.holds.pop(cid, None) is not None
        held = self.reader_holds.pop(cid, None) is not None or held
        return held or any(freed)

    # ---- segments coming and going --------------------------------------------------------------

    def adopted(self, checksum: str) -> None:
        """A segment adopted from a dead predecessor was loaded for its ranks' holds."""
        self.unclaimed.add(checksum)

    def is_held(self, checksum: str) -> bool:
        """Whether a segment was loaded because a rank held it (a successor releases it once they move on)."""
        return checksum in self.managed or checksum in self.unclaimed

    def dropped(self, checksum: str) -> None:
        """A segment left the table (unloaded, replaced, stopping)."""
        self.managed.discard(checksum)
        self.unclaimed.discard(checksum)

    def unload(self, checksum: str) -> None:
        """The owner unloaded `checksum`: not loaded again for the holds naming it now."""
        if checksum in self.wanted():
            self.unloaded.add(checksum)

    def load_started(self, path: str, size: int | None = None) -> None:
        """A load of `path` (a shard, or a block piece of `size` bytes) is queued: its pages count in
        the budget until it lands (`load_done`/`load_failed`)."""
        with contextlib.suppress(OSError):  # no size: the load fails, and counts nothing meanwhile
            footprint = pages(self.size(path) if size is None else size)
            self.loading_pages[path] = footprint
            self.loading_total += footprint

    def _load_ended(self, path: str) -> None:
        self.loading_total -= self.loading_pages.pop(path, 0)

    def load_failed(self, path: str, why: str) -> None:
        """A load of `path` failed: if a rank holds it, not loaded again until the file changes."""
        self._load_ended(path)
        expected = self.hold_loads.pop(path, None)
        held = expected or next((ck for ck, p in self.wanted().items() if p == path), None)
        if held is not None:
            self.hold_failed[path] = (held, _identity(path), why)
            if is_remote_url(path):
                self.backoff.failed(path)

    def load_done(self, path: str, checksum: str, *, asked: bool) -> None:
        """A load of `path` gave `checksum` (before the table has it); `asked`: a client waits for it.

        Held now, or loaded for a hold that moved on while it loaded (and asked for by no one
        else): the holds manage it, and the next plan drops it if none holds it.
        """
        self._load_ended(path)
        for_hold = self.hold_loads.pop(path, None) is not None
        self.backoff.succeeded(path)
        fresh = checksum not in self.segments
        holders = (*self.holds.values(), *self.reader_holds.values())
        if any(path in (p for p, _ in held) for held in holders) or (for_hold and fresh and not asked):
            self.managed.add(checksum)

    # ---- questions readers ask ------------------------------------------------------------------

    def on_its_way(self, path: str, checksum: str, loading: Container[str]) -> bool:
        """Whether the shard at `path` holding `checksum` is loading, or held and waiting for room."""
        if path in loading:
            return True
        return path in self.waiting_room and self.wanted().get(checksum) == path

    def why_not_held(self, path: str, checksum: str) -> str | None:
        """Why a held shard is not served (its load failed, or the owner unloaded it), if it is one."""
        if checksum in self.unloaded:
            return f"{path} was unloaded ('smstore unload') while held"
        return self.failed(path, checksum)

    def failed(self, path: str, checksum: str) -> str | None:
        """Why the held load of `path` (holding `checksum`) failed, while the file is still the one that failed."""
        entry = self.hold_failed.get(path)
        if entry is None:
            return None
        held, identity, why = entry
        if held == checksum and identity is not None and identity == _identity(path):
            return why
        del self.hold_failed[path]  # the file changed (or another checksum is held): try again
        return None

    def knows(self, manifest_path: str) -> bool:
        """Whether a hold named the manifest at `manifest_path` (it is kept parsed)."""
        return (
            manifest_file(manifest_path) if is_remote_url(manifest_path) else manifest_path
        ) in self.manifests

    def checksums(self, manifest_path: str) -> frozenset[str]:
        """The checksums of the shards of the manifest at `manifest_path` (what a reader follows).

        Raises:
            StoreError: The manifest is missing or bad.
        """
        manifest, _paths = self._manifest(manifest_path)
        return frozenset(s.checksum for s in manifest.shards)

    def manifest(self, path: str) -> tuple[Manifest, list[str]]:
        """The manifest at `path` and its shards' absolute paths (kept parsed; block holds use it too).

        Raises:
            StoreError: The manifest is missing or bad.
        """
        return self._manifest(path)

    def remote_manifest(self, url: str) -> Manifest | None:
        """The manifest fetched from `url` (by :meth:`add_remote`), if it is kept."""
        cached = self.manifests.get(manifest_file(url))
        return cached[1] if cached is not None else None

    def add_remote(self, url: str, manifest: Manifest) -> None:
        """Keep the manifest fetched from `url`: the holds naming it use it from now on, until
        :meth:`forget` (a hold naming another dataset there: it was replaced in the bucket)."""
        self._keep(manifest_file(url), (0, 0, 0, 0), manifest)

    def forget(self, url: str) -> None:
        self.manifests.pop(manifest_file(url), None)

    def _keep(self, path: str, key: FileIdentity, manifest: Manifest) -> list[str]:
        paths = [absolute(manifest.shard_path(k)) for k in range(len(manifest.shards))]
        for p, shard in zip(paths, manifest.shards, strict=True):
            if is_remote_url(p):
                self.remote_sizes[p] = shard.file_size
        if len(self.manifests) >= MAX_MANIFESTS:
            self.manifests.clear()
        self.manifests[path] = (key, manifest, paths)
        return paths

    def _manifest(self, path: str) -> tuple[Manifest, list[str]]:
        """The manifest at `path` and its shards' absolute paths, parsed again only if the file changed.

        Every rank holds at every window: parsing a manifest of thousands of shards each time
        would be milliseconds of the daemon's core at each window switch. A manifest in object
        storage is never fetched here (on the event loop): the daemon fetches it on a thread first.

        Raises:
            ManifestPending: `path` is a URL whose manifest was not fetched yet.
            StoreError: The manifest is missing or bad.
        """
        if is_remote_url(path):
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
            return manifest, [absolute(manifest.shard_path(k)) for k in range(len(manifest.shards))]
        return manifest, self._keep(path, key, manifest)
