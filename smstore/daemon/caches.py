"""Node caches of decoded samples, as the daemon serves them: parts created, sent, reset and described.

A cache (smstore/loading/node_cache.py) is a meta page of counters and chunks of records' rows,
each a memfd the daemon creates for the owner's processes: a part is a segment of the one segment
table, marked CACHED, counted in the one budget by the planner, which alone decides whether a
chunk fits (beside what the ranks' holds still need) and evicts the parts of caches no process
uses any more. Nothing here keeps state of its own: what a cache is lives in its parts.
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
import secrets
import time
from typing import Any

from smstore import _core
from smstore.daemon.connections import Conn, Server
from smstore.daemon.planner import CACHED, Planner
from smstore.daemon.segments import (
    CHUNK_BITS,
    COUNTER_NAMES,
    LAYOUT_WORD,
    META,
    META_BYTES,
    METRIC_COUNTERS,
    RESETS,
    TOLD_CHUNKS,
    CachePart,
    Segment,
    SegmentTable,
    cache_key,
    pages,
)
from smstore.wire.protocol import BAD_REQUEST, CacheRequest, ProtocolError

__all__ = ["cache_request", "cache_totals", "describe_caches", "detached"]

log = logging.getLogger("smstore.daemon")

# Caches at most (each a meta page and its chunks): past it, a new cache evicts idle ones or gets no room.
MAX_CACHES = 64
# Parts of every cache at most: each holds a descriptor of the daemon's (a client asking for tiny
# chunks must not spend them all): half of what the daemon may open, less a reserve for its
# connections and blobs. A client makes its chunks larger past 4,096 a cache.
DESCRIPTORS_KEPT = 4096
# The claim tokens of this daemon: its connections' ids under a number of its own, so that a
# process that kept a token of a dead predecessor never holds one of ours.
_GENERATION = secrets.randbits(30) + 1


def max_parts() -> int:
    """The most parts of decoded caches the daemon serves at once (see DESCRIPTORS_KEPT)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, (soft - DESCRIPTORS_KEPT) // 2)


def token(cid: int) -> int:
    """The claim token of connection `cid`'s process (csrc/claims.hpp: positive, never reused, and
    no other daemon's)."""
    return (_GENERATION << 32) | (cid & 0xFFFFFFFF)


def cache_request(server: Server, planner: Planner, cid: int, conn: Conn, req: CacheRequest) -> None:
    """Send connection `cid` part `req.chunk` of cache `req.cache` (creating it if it fits), or say
    there is no room; a lookup gets an existing cache's meta page and geometry, or "not found"."""
    segments = planner.segments
    meta = segments.get(cache_key(req.cache, META))
    if meta is not None:
        assert meta.cache is not None
        have = meta.cache.request
        if req.lookup:
            req = have._replace(chunk=META)
        elif have != req._replace(chunk=META):
            msg = (
                f"cache {req.cache[:12]} has {have.records} records, {have.rows} a chunk of "
                f"{have.slot_bytes} bytes (the last {have.last_bytes}), not {req.records}, {req.rows}, "
                f"{req.slot_bytes} and {req.last_bytes}"
            )
            raise ProtocolError(BAD_REQUEST, msg)
    elif req.lookup:
        server.reply(cid, {"ok": True, "found": False})
        return
    elif req.chunk != META:
        raise ProtocolError(BAD_REQUEST, f"cache {req.cache[:12]}: ask for its meta page (chunk -1) first")
    key = cache_key(req.cache, req.chunk)
    seg = segments.get(key)
    if seg is None:
        size = META_BYTES if req.chunk == META else req.chunk_bytes(req.chunk)
        why = None
        if req.chunk == META and len(_caches(segments)) >= MAX_CACHES:
            planner.evict_oldest_idle_cache()
            if len(_caches(segments)) >= MAX_CACHES:
                why = f"the daemon serves {MAX_CACHES} decoded caches in use, its most"
        if why is None and segments.cache_parts >= max_parts():
            why = f"the daemon serves {max_parts()} parts of decoded caches, its most (one descriptor each)"
        if why is None and not planner.cache_fits(size, req.cache):
            what = (
                "a cache's meta page" if req.chunk == META else f"chunk {req.chunk} of cache {req.cache[:12]}"
            )
            why = f"{what} ({size} bytes) does not fit the daemon's budget beside what the ranks hold"
        if why is not None:
            # Not a refusal: the process reads those records uncached, and asks again later.
            server.reply(cid, {"ok": True, "room": False, "message": why, "token": token(cid)})
            return
        seg = _create(segments, req, size)
    assert seg.cache is not None
    seg.clients[cid] = conn.pid
    conn.attached.add(seg.checksum)
    geometry = seg.cache.request
    reply = {
        "ok": True,
        "cache": req.cache,
        "chunk": req.chunk,
        "size": seg.size,
        "token": token(cid),
        "records": geometry.records,
        "rows": geometry.rows,
        "slot_bytes": geometry.slot_bytes,
        "last_bytes": geometry.last_bytes,
    }
    server.reply(cid, reply, fd=seg.fd)


def tell_chunk(segments: SegmentTable, part: CachePart, *, served: bool) -> None:
    """Set (or clear) a chunk's bit in its cache's meta page: whether the daemon serves it."""
    meta = segments.get(part.meta_key)
    if part.chunk == META or part.chunk >= TOLD_CHUNKS or meta is None or meta.cache is None:
        return
    at = CHUNK_BITS + part.chunk // 8
    bit = 1 << (part.chunk % 8)
    mem = meta.cache.mem
    mem[at] = mem[at] | bit if served else mem[at] & ~bit


def _caches(segments: SegmentTable) -> set[str]:
    return {s.cache.cache for s in segments.values() if s.cache is not None}


def _create(segments: SegmentTable, req: CacheRequest, size: int) -> Segment:
    import numpy as np  # here, not at import: its thread pool would start before SCHED_BATCH is set

    part = "meta" if req.chunk == META else str(req.chunk)
    name = f"smstore-cache-{req.cache[:12]}-{part}-{secrets.token_hex(4)}"
    fd = _core.memfd_create(name)
    try:
        os.ftruncate(fd, size)
        mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    if req.chunk == META:
        claims = np.frombuffer(mem, np.int64, 1, LAYOUT_WORD)
        counters = np.frombuffer(mem, np.uint64, len(COUNTER_NAMES))
        cache = CachePart(req._replace(chunk=META), req.chunk, mem, claims, counters)
    else:
        cache = CachePart(
            req._replace(chunk=META), req.chunk, mem, np.frombuffer(mem, np.int64, req.chunk_rows(req.chunk))
        )
    key = cache_key(req.cache, req.chunk)
    seg = Segment(name, key, fd, None, size, 0, [], time.time(), 0.0, mark=CACHED, cache=cache)
    segments[key] = seg
    tell_chunk(segments, cache, served=True)
    if req.chunk == META:
        log.info(
            "new decoded cache %s: %d records, %d a chunk of %d bytes",
            req.cache[:12],
            req.records,
            req.rows,
            req.slot_bytes,
        )
    return seg


def detached(segments: SegmentTable, seg: Segment, cid: int) -> None:
    """Connection `cid` closed: claims its processes left on `seg`'s records (a worker killed while
    writing one) go back to empty, so the record is decoded again, never read half-written."""
    part = seg.cache
    if part is None:
        return
    reset = _core.claims_reset(part.claims, token(cid))  # a meta page's: the layout it was telling
    if reset and part.chunk != META:
        log.info(
            "cache %s chunk %d: %d claim(s) of a closed connection reset", part.cache[:12], part.chunk, reset
        )
        meta = segments.get(part.meta_key)
        if meta is not None and meta.cache is not None and meta.cache.counters is not None:
            _core.counter_add(meta.cache.counters, RESETS, reset)


def describe_caches(segments: SegmentTable, limit: int) -> list[dict[str, Any]]:
    """What `status` says of each cache (the first `limit`): its geometry, parts, counters, clients."""
    out: dict[str, dict[str, Any]] = {}
    for seg in segments.values():
        part = seg.cache
        if part is None:
            continue
        entry = out.get(part.cache)
        if entry is None:
            if len(out) >= limit:
                continue
            entry = out[part.cache] = {
                "id": part.cache,
                "records": part.request.records,
                "rows": part.request.rows,
                "chunks": part.request.chunks,
                "held": 0,
                "ready": 0,
                "bytes": 0,
                **dict.fromkeys(COUNTER_NAMES, 0),
                "clients": [],
            }
        entry["bytes"] += pages(seg.size)
        if part.chunk == META:
            entry.update(part.counts())
            entry["clients"] = sorted(set(seg.clients.values()))
        else:
            entry["held"] += 1
            entry["ready"] += _core.claims_ready(part.claims)
    return list(out.values())


def cache_totals(segments: SegmentTable) -> dict[str, int]:
    """The metrics' counters (METRIC_COUNTERS) summed over the caches served now, and the bytes of
    their parts."""
    totals = dict.fromkeys(METRIC_COUNTERS, 0)
    for seg in segments.values():
        if seg.cache is not None:
            for name, value in seg.cache.counts().items():
                if name in totals:
                    totals[name] += value
    totals["bytes"] = segments.cache_pages
    return totals
