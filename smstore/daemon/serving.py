"""The segments the daemon serves: loads queued and finished, attaches, detaches, shares, unloads, and holds carried out."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.daemon.caches import detached, tell_chunk
from smstore.daemon.connections import Conn, Server
from smstore.daemon.loader import AlreadyLoaded, Failed, Indexed, Loaded, Loader, ManifestRead
from smstore.daemon.metrics import Counters
from smstore.daemon.planner import FETCH_BACKOFF, MAX_MANIFESTS, Loading, ManifestPending, Planner
from smstore.daemon.segments import EVICTIONS, META, METRIC_COUNTERS, Segment, SegmentTable, unlink_quietly
from smstore.daemon.sources import Source
from smstore.daemon.state import StateFile
from smstore.errors import DaemonError, StoreError
from smstore.wire.protocol import (
    BAD_REQUEST,
    NO_ROOM,
    Location,
    Piece,
    ProtocolError,
    attach_path_arg,
    checksum_arg,
    encode,
    key_arg,
    not_served,
    refusal,
)

__all__ = ["Serving", "describe"]

log = logging.getLogger("smstore.daemon")


# What `held` follows for another user's reader naming a manifest no hold named (never a path).
_NOTHING = Location("", False)


class Serving:
    """What the daemon does with its segments for its clients; the replies go out through `server`.

    It owns the loads in flight (and who waits for them) and the readers waiting for a held shard;
    the planner (`planner`) decides residency and the budget, the loader (`loader`) runs the loads.

    Args:
        server: The connection layer the replies go through.
        segments: The daemon's segment table.
        state: The state file, told of every change of the segments.
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
        shm_limit_from: Where ``shm_limit`` came from, for the messages that it refuses a load.
        segment_name: A fresh segment name for a checksum.
        gid: The group that may read the segments, or None for the owner only.
        read_rate: Read files (and fetch objects) at most this many bytes a second (0: no limit).
        cache_dir, cache_limit: The node cache of shards in object storage (None: fetched into segments).
        fetch_backoff: Seconds before a failed fetch is tried again for a hold (see `Backoff`).
    """

    def __init__(
        self,
        server: Server,
        segments: SegmentTable,
        state: StateFile,
        *,
        shm_limit: int,
        shm_limit_from: str,
        segment_name: Callable[[str], str],
        gid: int | None,
        read_rate: int,
        cache_dir: str | None = None,
        cache_limit: int = 0,
        fetch_backoff: float = FETCH_BACKOFF,
    ) -> None:
        self.server = server
        self.segments = segments
        self.state = state
        self.planner = Planner(
            segments,
            shm_limit=shm_limit,
            shm_limit_from=shm_limit_from,
            is_owner=lambda cid: (conn := server.conns.get(cid)) is not None and conn.owner,
            release=self._release,
            fetch_backoff=fetch_backoff,
            evicted=self._cache_evicted,
        )
        self.loader = Loader(
            segments,
            self.planner,
            segment_name,
            gid=gid,
            read_rate=read_rate,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
        )
        self.loads = 0  # loads finished (or failed) since the start
        self.counters = Counters()  # what the metrics count: loads, their bytes and time, readers' waits
        # What readers follow (`held`): the held shards and those not resident yet, its version
        # (one more at each change), and its replies, encoded once per dataset followed (None:
        # every held shard) for every reader of that version. Recomputed only once marked stale
        # (`held_stale`): by a change of the holds or of the segments.
        self.held_version = 0
        self._held_seen: tuple[list[list[str]], list[str]] | None = None
        self._held_stale = True
        self._held_frames: dict[Location | None, bytes] = {}

    @property
    def loading(self) -> dict[str, Loading]:
        """The loads under way by label (the planner's one count of them), with who waits for each."""
        return self.planner.loading

    def drop(self, seg: Segment) -> None:
        """Stop serving a segment now (unloaded, replaced, stopping): clients keep their mappings."""
        seg.close()
        self.segments.pop(seg.checksum, None)
        self.planner.dropped(seg.checksum)
        self._held_stale = True

    def _cache_evicted(self, seg: Segment) -> None:
        """The planner evicts a part of an idle decoded cache: counted (a meta page's counters kept
        for the metrics), and freed now: no process maps it."""
        part = seg.cache
        assert part is not None
        self.counters.add("decoded_evictions")
        if part.chunk == META:
            for name, value in part.counts().items():
                if name in METRIC_COUNTERS:
                    self.counters.add(f"decoded_{name}", value)
            log.info("evicted the idle decoded cache %s", part.cache[:12])
        else:
            meta = self.segments.get(part.meta_key)
            if meta is not None and meta.cache is not None and meta.cache.counters is not None:
                _core.counter_add(meta.cache.counters, EVICTIONS, 1)
            tell_chunk(self.segments, part, served=False)
        self.drop(seg)

    def _release(self, seg: Segment) -> None:
        """The planner released a held segment: out of the table, freed by the loader thread, off this loop."""
        self.segments.pop(seg.checksum, None)
        self.loader.free(seg)
        self._held_stale = True

    # ---- loading (a thread, so that a slow filesystem never blocks attaching clients) -----------

    def queue_load(
        self,
        source: Source,
        piece: Piece,
        cid: int | None,
        *,
        quiet: bool = False,
        size: int | None = None,
        for_hold: bool = False,
    ) -> None:
        """Load `piece` of `source` (a whole shard: a file or an object given to load, or a held
        shard; or a held record range) on the loader thread; `cid` waits for it, if given."""
        label = source.label(piece)
        first = label not in self.loading
        entry = self.planner.load_started(label, size, for_hold=for_hold)
        if first and not for_hold:
            self.planner.make_room(0)  # its pages are committed now: idle decoded caches make way
        if cid is not None:
            entry.waiters.append(cid)
            self.server.set_busy(cid, True)
        if first:
            self.loader.load(source, piece)
            if not quiet:
                log.info("loading %s", label)

    def finish_loads(self) -> list[ManifestRead]:
        """Carry on from what the loader ended; the manifests read (the server's: requests wait for them)."""
        removed, finished, manifests = self.loader.results()
        freed = [self.planner.freed(name) for name in removed]  # each of them, no short cut
        if any(freed):
            self.reconcile()  # room a held piece may wait for
        for source, piece, result in finished:
            if piece is None:  # an object's index: its pieces can be sized (or fail) now
                outcome = result.index if isinstance(result, Indexed) else result
                self.planner.indexed(source, outcome.error if isinstance(outcome, Failed) else outcome)
                self.reconcile()
                continue
            path = source.label(piece)
            entry = self.loading.get(path)
            waiters = entry.waiters if entry is not None else []
            self.loads += 1
            reply: dict[str, Any]
            failure: str | None = None
            if isinstance(result, Failed):
                log.error("failed to load %s: %s", path, result.error)
                failure = str(result.error)[:1000]
                self.counters.add("loads", label="failed")
                self.counters.add("load_failures", label=type(result.error).__name__)
                self.planner.load_failed(path, failure, source)
                reply = refusal(type(result.error).__name__, failure)
            else:
                assert not isinstance(result, Indexed)
                managed = self.planner.load_done(path, result.checksum, asked=bool(waiters), source=source)
                seg = self.register(path, result, managed=managed)
                reply = {"ok": True, **describe(seg)}
                if isinstance(result, Loaded):
                    self.counters.add("loads", label="loaded")
                    self.counters.add("load_bytes", seg.size)
                    self.counters.add("load_seconds", result.seconds)
                else:
                    self.counters.add("loads", label="already_loaded")
            for cid in waiters:
                self.server.set_busy(cid, False)
                self.server.reply(cid, reply)
                self.server.parse(cid)
            for cid, conn, _label, checksum, since in self._attach_waiting(path.__eq__):
                if cid not in self.server.conns:  # closed by a reply sent above
                    continue
                self._waited(since)
                self.server.set_busy(cid, False)
                seg_now = self.segments.get(checksum)
                if seg_now is None:
                    self.server.reply(cid, not_served(checksum, failure))
                else:
                    self._attach(cid, conn, seg_now)
                self.server.parse(cid)
            self.reconcile()
        return manifests

    def register(self, path: str, result: Loaded | AlreadyLoaded, *, managed: bool = False) -> Segment:
        """Serve what a load of `path` gave; `managed`: the holds manage it (`Planner.load_done`)."""
        # The generation this path held before (if other contents): no longer served by this path.
        previous = self.segments.serving(path)
        if isinstance(result, AlreadyLoaded):
            seg = self.segments[result.checksum]
            self.segments.add_path(seg, path)
        elif result.checksum in self.segments:
            # Another path with the same contents finished loading first: keep one copy.
            unlink_quietly(result.name)
            os.close(result.fd)
            seg = self.segments[result.checksum]
            self.segments.add_path(seg, path)
        else:
            name, fd, ck, seconds = result.name, result.fd, result.checksum, result.seconds
            store = _core.Store._from_fd(fd, path, False)
            seg = Segment(name, ck, fd, store, store.file_size, len(store), [path], time.time(), seconds)
            self.segments[seg.checksum] = seg
            log.info(
                "loaded %s: %d records, %d bytes in %.2f s (%.0f MiB/s) as /dev/shm/%s",
                path,
                seg.records,
                seg.size,
                seconds,
                seg.size / max(seconds, 1e-9) / 2**20,
                name,
            )
        if previous is not None and previous is not seg and path in previous.paths:
            self.segments.remove_path(previous, path)
            if not previous.paths:
                log.info("%s was rewritten: unloading the old generation %s", path, previous.checksum)
                self.drop(previous)
        if managed:  # marked before the state file may be written: it records the segment as held
            self.planner.manage(seg)
        self._held_stale = True
        self.state.changed()
        return seg

    def attach_request(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        checksum, key = checksum_arg(req), key_arg(req, required=False)
        if key is not None:
            seg = next((s for s in self.segments.values() if s.key == key), None)
        else:
            seg = self.segments.get(checksum) if checksum is not None else None
        named = attach_path_arg(req)
        path = None if named is None else named.name
        if seg is None and key is None and checksum is None and named is not None and named.remote:
            # An object loaded by its URL ('smstore load URL'), attached by it (the reader fetches
            # nothing to learn its checksum).
            seg = self.segments.serving(named.name)
        if (
            seg is None
            and path is not None
            and checksum is not None
            and self.planner.on_its_way(path, checksum)
        ):
            # A held shard on its way (loading, or waiting for room): answer when its load ends.
            # No file is read for this that a rank did not ask for.
            conn.waits_load = (path, checksum, time.monotonic())
            self.server.set_busy(cid, True)
            return
        if seg is None:
            why = (
                self.planner.why_not_held(path, checksum)
                if path is not None and checksum is not None
                else None
            )
            if why is None and path is not None:
                why = self.planner.last_failure(path)  # a load of it failed
            self.server.reply(cid, not_served(str(key or checksum or path), why))
            return
        self._attach(cid, conn, seg)

    # ---- residency: the planner decides, the server replies and queues ------------------------

    def hold(
        self,
        cid: int,
        manifest: Location,
        pieces: list[Piece],
        *,
        reply: bool,
        reader: bool = False,
        holder: int = 0,
    ) -> None:
        """Replace what connection `cid` holds; load what no one has loaded yet, drop what no one holds.

        The reply comes at once (none with ``"noreply": true``, unless the request is refused):
        loads run in the background, in the order given (the window being read first, then the
        next). A piece larger than the whole --shm-limit is refused here.
        """
        held = self.planner.hold(cid, manifest, pieces, reader=reader, holder=holder)
        if reply:
            resident = sum(h.key in self.segments for h in held)
            limit = self.planner.shm_limit  # the rank checks its windows fit two at a time
            self.server.reply(cid, {"ok": True, "resident": resident, "held": len(held), "limit": limit})
            self.server.flush(cid)  # the rank goes on at once; releases and loads follow
        self.reconcile()

    def reconcile(self) -> None:
        """Carry out the planner's plan: queue its loads, and answer readers waiting for what will not come."""
        plan = self.planner.plan()
        self._held_stale = True  # the holds, or what of them is loaded, may have changed
        for held, size in plan.loads:
            self.queue_load(held.source, held.piece, None, quiet=True, size=size, for_hold=True)
        for source in plan.indexes:
            self.loader.read_index(source)
        # Not on its way (no longer held, its load failed, unloaded): the readers hear so now.
        for cid, _conn, path, checksum, since in self._attach_waiting(
            lambda label: label not in self.loading and label not in self.planner.waiting_room
        ):
            self._waited(since)
            self.server.set_busy(cid, False)
            self.server.reply(cid, not_served(checksum, self.planner.why_not_held(path, checksum)))
            self.server.parse(cid)
        # One log line for each kind of change, however many shards: a window switch releases and
        # loads a window's worth on the daemon's loop, inside the switch (a line costs ~35 us).
        if plan.released:
            log.info("releasing %d piece(s) no rank holds: %s", len(plan.released), "; ".join(plan.released))
            self.state.changed()
        if plan.loads:
            log.info(
                "loading %d held piece(s): %s", len(plan.loads), ", ".join(h.label for h, _ in plan.loads)
            )
        self.held_changed()

    # ---- what readers follow: the held shards, sent at once or at their next change -------------

    def held(
        self, cid: int, conn: Conn, since: int | None, wait: float, manifest: Location | None = None
    ) -> None:
        """Reply with the held shards (of the dataset of `manifest` only, if given): at once if they
        changed since version `since`, else at their next change, or after `wait` seconds (parked,
        within the server's limits; at once if none).

        Another user's reader may name only a manifest a hold named (the daemon reads no other file
        for it): any other has no shard held through it, and it hears an empty list.

        Raises:
            StoreError: `manifest` is missing or bad (the reader hears so at once).
        """
        if manifest is not None and not conn.owner and not self.planner.knows(manifest):
            manifest = _NOTHING
        frame = self.held_frame(manifest)
        if since == self.held_version and wait and self.server.park(cid, wait):
            self.server.conns[cid].following = manifest
            return
        self.server.reply(cid, frame)

    def wake(self, cid: int) -> None:
        """Answer the parked `held` of connection `cid` (already unparked) now."""
        conn = self.server.conns.get(cid)
        manifest = conn.following if conn is not None else None
        if conn is not None:
            conn.following = None
        self.server.reply(cid, self._held_reply(manifest))

    def held_changed(self) -> None:
        """The holds or the segments may have changed: every reader parked on `held` hears if they did."""
        if not self.server.parked:
            return
        version = self.held_version
        self._held_update()
        if self.held_version != version:
            for cid in self.server.parked_ids():
                if self.server.unpark(cid):
                    self.wake(cid)

    def _held_update(self) -> None:
        """Recompute what readers follow if it may have changed; one more version if it did."""
        if not self._held_stale:
            return
        self._held_stale = False
        # A reader's own hold is no window to follow, and a record range is read through its own reader.
        wanted = self.planner.wanted(readers=False, whole=True)
        seen = ([[h.label, c] for c, h in wanted.items()], [c for c in wanted if c not in self.segments])
        if seen != self._held_seen:
            self._held_seen = seen
            self.held_version += 1
            self._held_frames.clear()

    def held_frame(self, manifest: Location | None = None) -> bytes:
        """The reply to `held`: the held shards (those of `manifest`'s dataset, if given) as
        ``[path, checksum]`` in the holders' order, the checksums among them not resident yet, and
        the version (changed at every change of either, of any dataset).

        Raises:
            StoreError: `manifest` is missing or bad.
        """
        self._held_update()
        frame = self._held_frames.get(manifest)
        if frame is not None:
            return frame
        assert self._held_seen is not None  # computed by _held_update, which runs first
        shards, not_resident = self._held_seen
        keep = True
        if manifest is not None:
            try:
                ours = frozenset() if manifest == _NOTHING else self.planner.checksums(manifest)
            except ManifestPending:
                # A dataset in object storage no hold has named yet: nothing of it is held (and
                # the daemon never fetches a manifest for a reader that only follows).
                ours, keep = frozenset(), False
            shards = [s for s in shards if s[1] in ours]
            not_resident = [c for c in not_resident if c in ours]
        reply = {"ok": True, "shards": shards, "not_resident": not_resident, "version": self.held_version}
        try:
            frame = encode(reply)
        except DaemonError as e:  # a dataset of tens of thousands of held shards with long paths
            log.warning(
                "the %d held shard(s)%s do not fit one reply: readers attach them as they read them (%s)",
                len(shards),
                f" of {manifest.name}" if manifest is not None else "",
                e,
            )
            frame = encode(refusal("reply_failed", str(e), version=self.held_version))
        if not keep:
            return frame
        if len(self._held_frames) >= MAX_MANIFESTS:
            self._held_frames.clear()
        self._held_frames[manifest] = frame
        return frame

    def _held_reply(self, manifest: Location | None) -> bytes:
        """`held_frame`, or (the manifest went bad since the reader parked) the refusal saying so."""
        try:
            return self.held_frame(manifest)
        except (StoreError, OSError) as e:
            return encode(refusal(type(e).__name__, str(e)[:1000], version=self.held_version))

    def _attach_waiting(self, ended: Callable[[str], bool]) -> list[tuple[int, Conn, str, str, float]]:
        """The readers' attaches that waited for a held piece whose wait `ended` (by its label),
        taken off their connections: (connection id, connection, label, checksum, since when)."""
        found: list[tuple[int, Conn, str, str, float]] = []
        for cid, conn in self.server.conns.items():
            if conn.waits_load is not None and ended(conn.waits_load[0]):
                found.append((cid, conn, *conn.waits_load))
                conn.waits_load = None
        return found

    def _waited(self, since: float) -> None:
        """A reader's attach that waited for a load since `since` is answered now."""
        self.counters.add("attach_waits")
        self.counters.add("attach_wait_seconds", time.monotonic() - since)

    def detach(self, cid: int, conn: Conn, checksum: str | None, *, reply: bool) -> None:
        """A reader unmapped a segment (it stays attached through its connection otherwise).

        With ``"noreply": true`` nothing is sent back: a reader releasing shards never waits.
        """
        if checksum is None:
            raise ProtocolError(BAD_REQUEST, "'detach' needs a checksum")
        # Any connection of the process speaks for all of them: a reader blocked waiting on one
        # connection detaches through another.
        cids = [
            c for c, other in self.server.conns.items() if other.pid == conn.pid and other.uid == conn.uid
        ]
        seg = self.segments.get(checksum)
        freed = False
        for c in cids:
            self.server.conns[c].attached.discard(checksum)
            if seg is not None:
                seg.clients.pop(c, None)
            freed = self.planner.unmapped(c, checksum) or freed
        if freed:
            self.reconcile()
        if reply:
            self.server.reply(cid, {"ok": True})

    def _attach(self, cid: int, conn: Conn, seg: Segment) -> None:
        seg.clients[cid] = conn.pid
        conn.attached.add(seg.checksum)
        self.server.reply(cid, {"ok": True, **describe(seg)}, fd=seg.fd)

    def share(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        """Serve a blob a client built in a sealed memfd (sent with the request) under its content key.

        The daemon holds it while any client is attached (the sharer included) and drops it after.
        """
        key = key_arg(req, required=True)
        fd = conn.take_fd()
        if fd is None:
            raise ProtocolError(BAD_REQUEST, "'share' needs the blob's descriptor sent with the request")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _core.memfd_sealed(fd):
                raise ProtocolError(
                    BAD_REQUEST, "'share' takes a sealed memfd (write, grow and shrink seals)"
                )
            self.planner.make_room(st.st_size)
            if not self.planner.fits(st.st_size):
                msg = f"a shared blob of {st.st_size} bytes does not fit the daemon's --shm-limit"
                raise ProtocolError(NO_ROOM, msg)
            # Sealed: its bytes can no longer change, so validating the index once makes every read safe.
            store = _core.Store._from_fd(fd, f"shared {key}", True)
        except BaseException:
            os.close(fd)
            raise
        seg = self.segments.get(store.checksum)
        if seg is None:
            seg = Segment(
                "", store.checksum, fd, store, store.file_size, len(store), [], time.time(), 0.0, key=key
            )
            self.segments[seg.checksum] = seg
            self._held_stale = True  # a held shard's checksum may now be resident
            log.info(
                "serving shared blob %s (%s, %d bytes) from pid %d", key, seg.checksum, seg.size, conn.pid
            )
        else:
            store.close()
            os.close(fd)
        self._attach(cid, conn, seg)
        self.held_changed()

    def unload(self, cid: int, checksum: str | None, path: str | None) -> None:
        seg = self.segments.get(checksum) if checksum is not None else None
        if seg is None and path is not None:
            seg = self.segments.serving(path)
        if seg is None:
            self.server.reply(cid, not_served(str(path or checksum)))
            return
        info = describe(seg)
        self.planner.unload(seg.checksum)
        self.drop(seg)
        self.state.changed()
        log.info(
            "unloaded %s (%s); %d client(s) still map it",
            ", ".join(seg.paths),
            seg.checksum,
            len(info["clients"]),
        )
        self.server.reply(cid, {"ok": True, **info})
        self.reconcile()  # readers waiting for it hear at once

    def closed(self, cid: int, conn: Conn) -> None:
        """Connection `cid` closed: its holds, attachments and waits go."""
        replan = self.planner.disconnect(cid)
        for checksum in conn.attached:
            seg = self.segments.get(checksum)
            if seg is not None:
                detached(self.segments, seg, cid)  # a decoded cache's claims it left go back to empty
                seg.clients.pop(cid, None)
                # A cache no process uses any more is room for what waits for it.
                replan = replan or (seg.cache is not None and not seg.clients)
                if seg.shared and not seg.clients:
                    log.info("dropping shared blob %s: no client left", seg.key)
                    self.drop(seg)
        if replan:
            self.reconcile()
        self.held_changed()  # a shared blob dropped may have been a held shard's resident copy


def describe(seg: Segment) -> dict[str, Any]:
    """What a reply says of a segment."""
    pids = sorted({p for p in seg.clients.values() if Path(f"/proc/{p}").exists()})
    return {
        "checksum": seg.checksum,
        "segment": f"memfd:{seg.key}" if seg.shared else f"memfd:{seg.name}" if seg.cache else "/" + seg.name,
        "key": seg.key,
        "paths": seg.paths,
        "size": seg.size,
        "records": seg.records,
        "loaded_at": seg.loaded_at,
        "load_seconds": seg.load_seconds,
        "adopted": seg.adopted,
        "clients": pids,
    }
