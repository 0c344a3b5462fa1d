"""open_store(): the daemon's shared-memory copy of a blob when it serves one, else a mapping of the
file; a dataset in object storage through the daemon only; StoreHandle, the store of a reader that
pickles as a path."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from smstore.errors import DaemonError, StoreChangedError
from smstore.format.manifest import (
    Manifest,
    Source,
    absolute,
    is_manifest,
    read_manifest,
    source_of,
)
from smstore.format.objects import OBJECT_ENCODINGS
from smstore.read.modes import Mode, check_mode, fall_back, log_once, warn_once
from smstore.read.shards import ShardedStore, open_sharded
from smstore.read.store import Store, open_blob, read_checksum
from smstore.remote.urls import needs_daemon
from smstore.wire.client.session import (
    DaemonObjectStore,
    DaemonSession,
    DaemonStore,
    keep_attached,
    session_for,
)
from smstore.wire.ipc import connect, socket_path, wait_until_served
from smstore.wire.protocol import MAX_WAIT, NOT_SERVED, PERMISSION_DENIED

__all__ = ["Preattacher", "StoreHandle", "open_store", "open_url"]

log = logging.getLogger("smstore")


def open_store(
    path: str | os.PathLike[str],
    mode: Mode = "auto",
    socket: str | os.PathLike[str] | None = None,
    *,
    checksum: str | None = None,
    manifest: Manifest | None = None,
) -> Store | ShardedStore:
    """Open a blob: the daemon's shared-memory copy, or a read-only mapping of the file.

    A sharded dataset in object storage (``s3://bucket/ds/``, or the URL of its manifest) is read
    through the node's daemon only: its shards are fetched by ``smstore serve`` once a sampler
    holds them. Mode ``"auto"`` then requires a daemon, as ``"daemon"`` does; ``"mmap"`` is refused.

    A sharded dataset (a manifest, or a directory holding one) opens as a ``ShardedStore`` whose
    shards are each attached the same way on first use, through one daemon connection per
    process, and matched by the checksum the manifest records.

    The daemon and the file are matched by content: the checksum in the file's header (a 4 KiB
    read) must be one the daemon serves. Each call makes its own connection, so this is safe in
    forked DataLoader workers. This is the one attach policy of every reader that pickles as a
    path and attaches in each process (``SharedStoreDataset``, ``TokenCollator``, through
    :class:`StoreHandle`).

    Args:
        path: The ``.smst`` file, or a sharded dataset.
        mode: ``"auto"`` uses the daemon's copy if it serves this file, else maps the file (and
            logs once, on the ``smstore`` logger, which it chose; falling back warns as every
            reader does: :func:`smstore.read.modes.fall_back`); ``"daemon"`` requires the daemon;
            ``"mmap"`` never asks it.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET`` or the per-user default).
        checksum: The contents this process must read (the checksum another process saw when it
            opened the blob): a reader created in one process and attached in another never reads
            other records than its creator did.
        manifest: The manifest of a dataset URL, already read (a handle unpickled in a worker
            passes its creator's: the worker fetches nothing).

    Raises:
        ValueError: ``mode`` is none of ``"auto"``, ``"daemon"``, ``"mmap"``.
        RemoteNeedsDaemonError: A URL with ``mode="mmap"``, or a URL and no daemon answers.
        DaemonError: ``mode="daemon"`` and no daemon answers, or it does not serve this file.
        StoreChangedError: ``checksum`` is given and the blob now holds other contents.
        StoreError: The file is missing or not a valid blob (when it has to be opened).
    """
    store: Store | ShardedStore = _open(path, mode, socket, manifest)
    if checksum is not None and (now := store.checksum) != checksum:
        store.close()
        msg = (
            f"{os.fspath(path)}: the file changed since this reader was created (checksum {checksum}, "
            f"now {now}); create it again to read the new file"
        )
        raise StoreChangedError(msg)
    return store


def open_url(
    url: str, *, verify: bool = False, raw: bool = False, socket: str | os.PathLike[str] | None = None
) -> Store | ShardedStore:
    """:func:`smstore.open` of a URL: a dataset or blob in object storage, read through the node daemon.

    A dataset (``s3://bucket/ds/``, or its manifest's URL) opens as a ``ShardedStore`` (a
    ``ShardedObjectStore`` for objects, unless `raw`) whose shards the daemon fetches as samplers
    hold them, or for this reader when none does; one blob (``s3://bucket/x.smst``) opens as the
    daemon's copy once the owner loaded it (``smstore load URL``). `verify` reads every record
    through the daemon (which checked each object's checksum as it fetched it).

    Raises:
        RemoteNeedsDaemonError: No daemon answers (only the daemon fetches from object storage).
        DaemonError: The daemon does not serve the blob.
        RemoteURLError, RemoteError: A URL smstore will not fetch, or a read failed.
    """
    store = _open_remote(url, "daemon", socket, None, raw=raw, decode_blob=not raw)  # smstore.open decided it
    if verify:
        try:
            store.verify()
        except BaseException:
            store.close()
            raise
    return store


class StoreHandle:
    """The store of a reader that pickles as a path: opened in each process that reads it, contents pinned.

    Made in one process, it opens the blob (or sharded dataset) there with :func:`open_store` and
    pins its checksum. It pickles as ``path``, ``mode``, ``socket`` and ``checksum`` only, never a
    mapping or a connection; a process that unpickles it (a ``spawn`` or ``forkserver`` worker)
    opens its own store on first use of :attr:`store`, through :func:`open_store` with that
    checksum, so it reads the very contents its creator read or raises. A ``fork`` child keeps
    its parent's mapping (the daemon connection behind it is dropped at the fork). The one
    re-attach logic of ``SharedStoreDataset`` and ``TokenCollator``.

    Args:
        path: The ``.smst`` file, or a sharded dataset; kept (and pickled) as an absolute path,
            so a process started in another directory reads the same file.
        mode: ``"auto"``, ``"daemon"`` or ``"mmap"``, as in :func:`open_store`.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET`` or the per-user default), the
            same in every process the handle is pickled to (kept absolute too).

    Raises:
        ValueError: ``mode`` is none of those.
        DaemonError: ``mode="daemon"`` and no daemon serves the file.
        StoreError: The file is missing or not a valid blob.
    """

    __slots__ = ("_store", "checksum", "manifest", "mode", "path", "socket")

    def __init__(
        self, path: str | os.PathLike[str], mode: Mode = "auto", socket: str | os.PathLike[str] | None = None
    ) -> None:
        # Absolute: a process it is pickled to may run in another directory (a relative path
        # would name another file there, or none). A URL stays as it is.
        self.path = absolute(os.fspath(path))
        self.mode: Mode = check_mode(mode)
        self.socket = os.path.abspath(os.fspath(socket)) if socket is not None else None
        self._store: Store | ShardedStore | None = open_store(self.path, self.mode, self.socket)
        self.checksum: str = self._store.checksum  # every process must read these very bytes
        # A dataset in object storage pickles with its manifest: a worker fetches nothing.
        self.manifest: Manifest | None = (
            self._store.manifest
            if isinstance(self._store, ShardedStore) and self._store.manifest.remote
            else None
        )

    @property
    def store(self) -> Store | ShardedStore:
        """The store this process reads (opened on first use in a process, and again once closed).

        Raises:
            StoreChangedError: The file holds other contents than when the handle was made (it was
                re-packed or overwritten since): the message names the file and both checksums.
        """
        store = self._store
        if store is None or store.closed:
            store = self._store = open_store(
                self.path, self.mode, self.socket, checksum=self.checksum, manifest=self.manifest
            )
        return store

    @property
    def attached(self) -> bool:
        """Whether this process has its store open (a handle just unpickled has not)."""
        return self._store is not None and not self._store.closed

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "path": self.path,
            "mode": self.mode,
            "socket": self.socket,
            "checksum": self.checksum,
        }
        if self.manifest is not None:
            state["manifest"] = self.manifest
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.mode = check_mode(state["mode"])
        self.socket = state["socket"]
        self.checksum = state["checksum"]
        self.manifest = state.get("manifest")
        self._store = None

    def __repr__(self) -> str:
        return f"StoreHandle({self.path!r}, mode={self.mode!r}, checksum={self.checksum!r})"


def _open(
    path: str | os.PathLike[str],
    mode: Mode,
    socket: str | os.PathLike[str] | None,
    manifest: Manifest | None = None,
    *,
    raw: bool = False,
    decode_blob: bool = False,
) -> Any:
    """`raw`: a sharded dataset of objects opens undecoded; `decode_blob`: a blob URL of objects
    opens decoded (smstore.open's rule; open_store's, as for a local blob: raw)."""
    mode = check_mode(mode)
    spath = os.fspath(path)
    if source_of(spath).remote:
        return _open_remote(spath, mode, socket, manifest, raw=raw, decode_blob=decode_blob)
    if is_manifest(spath):
        return _open_sharded(spath, mode, socket)
    if mode == "mmap":
        return open_blob(spath)
    try:
        checksum = read_checksum(spath)
    except OSError:
        checksum = None
    if checksum is None:
        # Missing, unreadable or not a blob: let the reader raise its precise error.
        return open_blob(spath)
    return _attach(spath, checksum, mode, socket_path(socket), None)


class Preattacher:
    """Attaches, ahead of the reads, the shards of one dataset that a rank holds in the daemon,
    and unmaps those it no longer holds.

    A windowed sampler makes the daemon hold the window being read and the next (see
    :class:`smstore.wire.residency.Residency`). A thread of each reading process follows what is
    held: it asks the daemon (``held``), attaches the held shards of its dataset that are resident
    and not opened yet, and keeps them ready, so that the first read of a new window finds its
    shards attached instead of making a round trip to the daemon per shard on the critical path.
    Ready shards the daemon no longer holds are closed. Then it asks again with the version it
    saw: the daemon answers when what is held, or resident, changes (or after `WAIT` seconds), so
    the thread sleeps in a read between two changes instead of asking 10 times a second. The
    question goes on the process's one session (a parked question never delays the requests sent
    after it: the daemon answers it as soon as one follows), and a forked child starts its own
    thread on its first read.
    """

    WAIT = 30.0  # seconds the daemon may keep a question before it answers "no change"
    POLL = 0.1  # seconds before asking again after an answer with no change (a daemon over its
    # limit of parked questions answers at once)
    RETRY = 0.5  # ... and after a failure (no daemon now), doubled at each failure in a row
    MAX_RETRY = 30.0  # ... up to this

    def __init__(
        self,
        sock: Path,
        manifest: str,
        checksums: dict[str, int],
        is_open: Callable[[int], bool],
        release: Callable[[int], None],
    ) -> None:
        self.sock = sock
        self.manifest = absolute(manifest)  # the daemon answers with this dataset's shards only
        self.refused: str | None = None  # the daemon's last refusal, logged once
        self.checksums = checksums  # checksum -> shard index, for this dataset
        self.is_open = is_open
        self.release = release
        self.ready: dict[str, DaemonStore] = {}
        self._pid = -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Orders the thread's attaches and additions to `ready` with close(): once close() set
        # `_stop` and took the lock, the thread neither attaches nor keeps a store. Reentrant: the
        # dataset's finalizer (close) may run in the thread itself.
        self._lock = threading.RLock()
        keep_attached(self)

    @property
    def session(self) -> DaemonSession:
        """This process's session with the daemon (a forked child's own)."""
        return session_for(self.sock)

    def take(self, checksum: str) -> DaemonStore | None:
        """The attached shard holding `checksum`, if the thread has one ready (it is handed over)."""
        self._start()
        store = self.ready.pop(checksum, None)
        return None if store is None or store.closed else store

    def _start(self) -> None:
        if self._pid != os.getpid():  # first use in this process (a forked child inherits no thread)
            self._pid = os.getpid()
            self.ready = {}
        elif self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
            return
        # First use, or the thread ended with its daemon gone: a daemon serving again (a read
        # found one) gets a thread again.
        self._thread = threading.Thread(target=self._run, name="smstore-preattach", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = os.getpid()
        seen: int | None = None  # the version of the held shards handled last
        retry = self.RETRY
        while not self._stop.is_set() and pid == os.getpid():
            try:
                version = self._once(seen)
            except Exception as e:
                if not isinstance(e, (DaemonError, OSError)):
                    log.debug("pre-attaching failed", exc_info=True)
                seen = None  # no daemon now: the reads attach (or fail) on their own
                if not self.sock.exists():
                    break  # the daemon is gone for good (it removes its socket): the next read restarts us
                self._stop.wait(retry)  # a daemon restarting, or one that refuses us: less often each time
                retry = min(2 * retry, self.MAX_RETRY)
                continue
            retry = self.RETRY
            if version is None or version == seen:
                self._stop.wait(self.POLL)
            seen = version

    def _once(self, since: int | None) -> int | None:
        """Handle the held shards, once they changed since version `since`; the version handled."""
        question: dict[str, Any] = {"op": "held", "wait": self.WAIT, "manifest": self.manifest}
        if since is not None:
            question["since"] = since
        reply, fd = self.session.ask(question, MAX_WAIT + 10.0)
        if fd is not None:
            os.close(fd)
        version = reply.get("version")
        if not isinstance(version, int):
            version = None  # a daemon that does not park questions (older): asked again after POLL
        elif version == since:
            return since
        if not reply.get("ok"):
            # No list this time (too many held shards for one reply, a manifest gone bad): the
            # reads attach their shards themselves; what is ready stays ready.
            why = str(reply.get("message", reply.get("error")))
            if why != self.refused:
                log.warning(
                    "smstore: %s: cannot attach held shards ahead of the reads: %s", self.manifest, why
                )
                self.refused = why
            return version
        self.refused = None
        not_resident = set(reply.get("not_resident", ()))
        held = [(p, c) for p, c in reply.get("shards", []) if c in self.checksums]
        wanted = {c for _p, c in held}
        if held:
            # The ranks read a window of this dataset: a shard they no longer hold is unmapped now
            # (its memory counts against the daemon's budget until then), not when it goes idle.
            for checksum, k in self.checksums.items():
                if checksum not in wanted and self.is_open(k):
                    self.release(k)
        for checksum in list(self.ready):
            if checksum not in wanted and (store := self.ready.pop(checksum, None)) is not None:
                store.close()  # released: do not keep it mapped
        for path, checksum in held:
            if (
                checksum in not_resident
                or checksum in self.ready
                or self.is_open(self.checksums[checksum])
                or self._stop.is_set()
            ):
                continue
            with self._lock:
                if self._stop.is_set():  # closed meanwhile: the session must not connect again
                    break
                # Resident ones only: this connection never waits.
                reply, fd = self.session.attach(checksum)
            if fd is None:
                continue  # unloaded meanwhile: the next change says so
            try:
                store = DaemonStore(fd, path, reply, None, self.session)
            finally:
                os.close(fd)
            if store.checksum != checksum:
                store.close()
                continue
            with self._lock:
                stopped = self._stop.is_set()
                if not stopped:
                    self.ready[checksum] = store
            if stopped:  # close() emptied `ready` already: this one would stay mapped
                store.close()
                break
        return version

    def _after_fork_in_child(self) -> None:
        self._lock = threading.RLock()  # the parent's thread may have held it at the fork

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ready, self.ready = list(self.ready.values()), {}
        for store in ready:
            store.close()
        thread = self._thread
        if self._pid == os.getpid() and thread is not None and thread.is_alive():
            # Any request after its parked question has the daemon answer it: the thread sees
            # `_stop` now rather than at the question's deadline.
            with contextlib.suppress(DaemonError):
                self.session.send({"op": "status", "limit": 0}, lambda _reply, _error: None)


def _open_remote(
    url: str,
    mode: Mode,
    socket: str | os.PathLike[str] | None,
    manifest: Manifest | None,
    *,
    raw: bool = False,
    decode_blob: bool = False,
) -> Store | ShardedStore:
    """A dataset (or one blob) in object storage: its manifest fetched here, its shards attached
    from the daemon.

    Raises:
        RemoteNeedsDaemonError: ``mode="mmap"``, or no daemon answers: said now, not at the first read.
    """
    what = "a dataset" if is_manifest(url) else "a blob"
    if mode == "mmap":
        raise needs_daemon(url, what, why='mode="mmap" cannot read it (use "daemon" or "auto")')
    sock_at = socket_path(socket)
    try:
        connect(sock_at).close()
    except DaemonError as e:
        raise needs_daemon(url, what, why=str(e)) from None
    if what == "a blob":
        return _open_remote_blob(url, sock_at, decode=decode_blob)
    return _open_sharded(
        url, "daemon", socket, manifest if manifest is not None else read_manifest(url), raw=raw
    )


def _open_remote_blob(url: str, sock_at: Path, *, decode: bool = False) -> Store:
    """One blob in object storage (``s3://bucket/x.smst``): the daemon's copy, which it holds once
    the owner loaded it (``smstore load URL``, or ``smstore serve URL``), attached by its URL (this
    process fetches nothing). With `decode`, a blob of objects decodes its items
    (:class:`DaemonObjectStore`).

    Raises:
        DaemonError: The daemon does not serve it (why, and how to load it).
    """
    session = session_for(sock_at)
    reply, fd = session.ask({"op": "attach", "path": url}, 10.0)
    if fd is None:
        hint = (
            ""
            if url.endswith(".smst")
            else " (a dataset's URL ends in '/', naming its prefix, or in '.json', naming its manifest)"
        )
        msg = (
            f"{url}: a blob in object storage is read from the node daemon's copy, and the daemon on "
            f"{sock_at} does not serve it ({reply.get('message', reply)}): load it first "
            f"('smstore load {url}'){hint}"
        )
        raise DaemonError(msg)
    try:
        store = DaemonStore(fd, url, reply, None, session)
        if decode and store.encoding in OBJECT_ENCODINGS:
            store.detach_through(None)  # attached still, by the decoding store made of the same fd
            store.close()
            store = DaemonObjectStore(fd, url, reply, None, session)
    finally:
        os.close(fd)
    return store


def _open_sharded(
    spath: str,
    mode: Mode,
    socket: str | os.PathLike[str] | None,
    manifest: Manifest | None = None,
    *,
    raw: bool = False,
) -> ShardedStore:
    """A sharded dataset whose shards attach, on first use, through one connection per process."""
    if mode == "mmap":
        return open_sharded(spath, raw=raw)
    session = session_for(socket)
    store_ref: Callable[[], ShardedStore | None] = lambda: None

    def is_open(k: int) -> bool:
        store = store_ref()
        return store is not None and not store.closed and store.is_shard_open(k)

    if manifest is None:
        manifest = read_manifest(spath)

    def release(k: int) -> None:
        store = store_ref()
        if store is not None and not store.closed:
            store.release_shard(k)

    index = {s.checksum: k for k, s in enumerate(manifest.shards)}
    ahead = Preattacher(session.path, manifest.path, index, is_open, release)
    # A shard in object storage no sampler holds is held by the dataset's readers themselves,
    # one at a time, under a holder of their own (apart from the process's samplers').
    fetching = _Fetching(manifest, DaemonSession.new_holder(), threading.Lock())

    def opener(source: Source) -> Store:
        assert source.checksum is not None  # a manifest's sources record it
        ready = ahead.take(source.checksum)
        if ready is not None:
            return ready
        # By the checksum the manifest records: a served shard's file is never read.
        return _attach(
            source.location, source.checksum, mode, session.path, session, (fetching, index[source.checksum])
        )

    # The session is closed with the store's last reference.
    store = open_sharded(
        spath,
        opener=opener,
        check_files=mode != "daemon",
        keep_alive=(session, ahead),
        manifest=manifest,
        raw=raw,
    )
    store_ref = weakref.ref(store)
    weakref.finalize(store, ahead.close)
    return store


def _not_yet_served(reply: dict[str, Any], fd: int | None) -> bool:
    """The daemon does not serve the shard and gives no reason: it may yet (a hold on its way)."""
    return fd is None and reply.get("error") == NOT_SERVED and not reply.get("reason")


class _Fetching(NamedTuple):
    """What a dataset's readers need to hold a shard in object storage for themselves."""

    manifest: Manifest
    holder: int  # their holder on the process's session
    lock: threading.Lock  # the hold and the attach together: another reader's hold would replace it


def _fetch_for_reader(
    session: DaemonSession, checksum: str, url: str, shard: tuple[_Fetching, int]
) -> tuple[dict[str, Any], int | None]:
    """The daemon's answer for a shard in object storage that it does not serve now.

    No sampler holds it: none is used (a plain sampler, or reads outside an epoch), or the
    sampler's ``lag`` released it while DataLoader workers still read it, or its hold has not
    reached the daemon yet. A shard on local disk would be read from its file; one in object
    storage has none, so this process holds it itself (one shard at a time, replacing the last:
    the daemon fetches it through its node cache, within its budget) and attaches it once it is
    loaded. Correct, but slower than a hold made ahead (a warning says so once). A reader the
    daemon does not let hold (a member of its ``--group``) waits for the owner's samplers instead.

    Raises:
        DaemonError: The daemon refused the hold (why: its budget, the shard's fetch failed, the
            manifest in the bucket was replaced), or never served the shard.
    """
    fetching, k = shard
    manifest = fetching.manifest
    warn_once(
        f"{manifest.path}: unheld",
        "%s: shard %s is read while no sampler holds it: fetched for this reader (slower than a "
        "hold ahead). Read a dataset in object storage with WindowedShuffleSampler (lag at least "
        "prefetch_factor * num_workers * batch_size) or BlockWindowSampler, or load it whole first "
        "('smstore load %s')",
        manifest.path,
        url,
        manifest.path,
    )
    with fetching.lock:
        held = session.hold_shard(manifest, k, fetching.holder)
        if held.get("ok"):
            # Held until this process holds another shard so, or closes: planned after the
            # samplers' shards, and released first when one of theirs needs the room.
            reply, fd = session.attach(checksum, url)  # waits for the load the hold started
            if not _not_yet_served(reply, fd):
                return reply, fd
    if held.get("ok") or held.get("error") == PERMISSION_DENIED:
        # Released again at once (the owner unloaded it, say), or a reader that may not hold: the
        # owner's samplers hold for it. Waited for outside the lock: the session's other threads
        # attach and detach meanwhile.
        return _wait_for_remote(session, checksum, url)
    msg = f"{url}: the smstore daemon on {session.path} cannot serve it: {held.get('message', held)}"
    raise DaemonError(msg)


def _wait_for_remote(session: DaemonSession, checksum: str, url: str) -> tuple[dict[str, Any], int | None]:
    """The daemon's answer for a shard in object storage once it serves it, or says why it never will."""

    def ask() -> tuple[dict[str, Any], int | None] | None:
        reply, fd = session.attach(checksum, url)
        return None if _not_yet_served(reply, fd) else (reply, fd)

    what = (
        f"{url}: a shard in object storage is fetched by the node's daemon once a sampler holds it "
        "(WindowedShuffleSampler)"
    )
    return wait_until_served(ask, what)


def _attach(
    spath: str,
    checksum: str,
    mode: Mode,
    sock_at: Path,
    session: DaemonSession | None,
    shard: tuple[_Fetching, int] | None = None,
) -> Store:
    """The daemon's copy of the blob at `spath` holding `checksum`, or (mode "auto") a mapping of the file.

    `shard`: the manifest and index of the shard at `spath` (a reader of one in object storage
    that no sampler holds holds it itself).
    """
    if session is None:
        session = session_for(sock_at)
    # A shard in object storage has no file to fall back on: whatever the mode, the reader hears why.
    remote = shard is not None and shard[0].manifest.sources[shard[1]].remote
    try:
        reply, fd = session.attach(checksum, spath)
        if shard is not None and remote and _not_yet_served(reply, fd):
            reply, fd = _fetch_for_reader(session, checksum, spath, shard)
    except DaemonError as e:
        if remote:
            raise needs_daemon(spath, "a shard", why=str(e)) from None
        fall_back(mode, spath, str(e), sock_at, "file")
        return Store(spath)
    if not reply.get("ok") or fd is None:
        if fd is not None:
            os.close(fd)
        if reply.get("error") == NOT_SERVED and not reply.get("reason"):
            reason = (
                f"the smstore daemon on {sock_at} does not serve this file (checksum {checksum}); "
                f"load it with 'smstore load {spath}'"
            )
        elif reply.get("error") == NOT_SERVED:  # a held shard whose load failed, or unloaded
            reason = f"the smstore daemon on {sock_at} does not serve this file: {reply.get('message')}"
        else:
            reason = f"the smstore daemon on {sock_at} refused: {reply.get('message')}"
        if remote:
            raise DaemonError(f"{spath}: {reason}")
        fall_back(mode, spath, reason, sock_at, "file")
        return Store(spath)
    try:
        store = DaemonStore(fd, spath, reply, None, session)
        if (held := store.checksum) != checksum:
            store.close()
            msg = f"{spath}: the daemon on {sock_at} sent a segment holding {held}, not {checksum}"
            raise DaemonError(msg)
    finally:
        os.close(fd)  # the mapping holds the segment now
    log_once(spath, "daemon", "%s: using the smstore daemon's shared-memory copy %s", spath, store.segment)
    return store
