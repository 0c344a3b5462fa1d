"""SharedList: a list of Python objects serialized once per node into sealed shared memory that every local process reads."""

from __future__ import annotations

import ctypes
import errno
import gc
import itertools
import os
import pickle
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, overload

from smstore import _core
from smstore.errors import DaemonError, SharedListError, SharedListMismatchError, SharedMemoryError
from smstore.format.objects import ContentHash, ObjectStore, encode_objects
from smstore.read.localjob import Peer, Server, address_for, connect, topology
from smstore.read.memory import available_memory
from smstore.read.modes import Mode, check_mode, fall_back
from smstore.read.sources import daemon_key, file_key, file_loader
from smstore.write.pack import build_metadata, human_bytes

__all__ = ["SharedList"]

_MEMFD_PREFIX = "smstore-list:"  # how the segment shows in /proc/PID/fd and /proc/PID/maps
# Room is checked after the first objects and then every this many bytes (reading /proc/meminfo
# and the cgroup's files costs tens of microseconds).
_ROOM_FIRST_CHECK = 1024
_ROOM_CHECK_EVERY = 8 << 20
# How long a waiter waits for the builder's first word once connected: it answers from a thread.
_HELLO_TIMEOUT = 60.0
# How often a waiter hashing its own list looks whether the builder died meanwhile.
_ALIVE_EVERY = 0.2

_PR_SET_PDEATHSIG = 1  # prctl(2)
# The loading child's first garbage-collector threshold (allocations net of frees; default 700).
_CHILD_GC_THRESHOLD = 100_000

_sequence = itertools.count()


class _RoomCheck:
    """Stops a build whose projected size will not fit, with the size and the fixes (never an OOM kill)."""

    def __init__(self, label: str, total: int | None, limit: int) -> None:
        self._label = label
        self._total = total
        self._limit = limit
        self.next_check = (
            0  # the data size at which the next call may check (callers may skip calls before it)
        )

    def __call__(self, records: int, data_size: int) -> None:
        if records < _ROOM_FIRST_CHECK and records != self._total:
            return
        if data_size < self.next_check:
            return
        self.next_check = data_size + _ROOM_CHECK_EVERY
        if self._total:
            # Project from what is done: the rest of the objects are like the first ones.
            needed = int(data_size / records * self._total) + 8 * (self._total + 1) + 8192
            basis = f"estimated from the first {records} of {self._total} objects"
        else:
            needed = data_size + 8192
            basis = f"after {records} objects, and more to come"
        available, source = (self._limit, "room_limit") if self._limit > 0 else available_memory()
        # What is already written is already counted as used.
        if needed - data_size <= available:
            return
        gib = -(-needed // (1 << 30))
        msg = (
            f"{self._label}: not enough memory: the list needs about {human_bytes(needed)} ({needed} bytes, "
            f"{basis}) of shared memory, but only {human_bytes(data_size + available)} is available "
            f"({source}). A SharedList keeps one copy per node in anonymous shared memory (a memfd): it "
            "counts against the node's memory and the job's memory limit, not against /dev/shm. Make "
            f"room: raise the limit (docker run --memory={gib + gib // 4 + 1}g, Kubernetes "
            "resources.limits.memory, Slurm --mem), free memory on the node, or share a smaller list "
            "(drop fields you do not read)."
        )
        raise SharedMemoryError(msg)


def _new_memfd(name: str) -> int:
    # A sealed memfd can never change again: readers trust its bytes after an O(1) header check.
    return _core.memfd_create(_MEMFD_PREFIX + name)


def _write(
    fd: int, objects: Iterable[Any], name: str, encoding: str, room_limit: int, *, hash_content: bool = True
) -> dict[str, Any]:
    """Encode ``objects`` into the empty memfd ``fd`` as a complete blob (``fd`` stays the caller's).

    ``hash_content``: compute the content hash that waiting ranks compare their lists with (the
    loader form needs none: its ranks compare keys).
    """
    label = f"SharedList {name!r}"
    writer = _core.Writer.to_fd(os.dup(fd), label)  # owns the duplicate from here on
    content = ContentHash() if hash_content else None
    room = _RoomCheck(label, len(objects) if isinstance(objects, Sequence) else None, room_limit)
    count = size = 0
    try:
        for record in encode_objects(objects, encoding):
            if content is not None:
                content.update(record)
            writer.append(record)
            count += 1
            size += len(record)
            if size >= room.next_check:  # a running sum: no call per record between checks
                room(count, writer.data_size)
        info: dict[str, Any] = {"encoding": encoding, "records": count}
        extra: dict[str, Any] = {"shared_list": name}
        if content is not None:
            info["content"] = extra["content_hash"] = content.hexdigest()
        done = writer.finish_fd(build_metadata(encoding, **extra))
    except BaseException:
        writer.abort()
        raise
    os.close(done)
    return info


def _seal(fd: int, name: str) -> int:
    """Seal the memfd ``fd`` and close it; returns a read-only descriptor of it."""
    try:
        # Readers get a read-only open of it: no descriptor that could write exists past this point.
        return _core.memfd_seal(fd, _MEMFD_PREFIX + name)
    finally:
        os.close(fd)


def _build(objects: Iterable[Any], name: str, encoding: str, room_limit: int) -> tuple[int, dict[str, Any]]:
    """Encode ``objects`` into a new sealed memfd blob; returns a read-only fd and what waiters need."""
    fd = _new_memfd(name)
    try:
        info = _write(fd, objects, name, encoding, room_limit)
    except BaseException:
        os.close(fd)
        raise
    return _seal(fd, name), info


def _die_with_parent() -> None:
    # A loading child whose rank was killed must not go on filling memory nobody will read.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _collect_rarely() -> None:
    """Make the cyclic garbage collector cheap in the loading child (it halves the time of a large json.load).

    A parser builds millions of containers that all survive: at the default thresholds the
    collector walks them again and again, and walks the parent's heap (torch's objects) too,
    copying those pages on write. Frozen, the parent's objects are never walked; with a large
    first threshold the new ones are walked rarely. Cyclic garbage is still collected.
    """
    gc.freeze()
    gc.set_threshold(_CHILD_GC_THRESHOLD, 50, 100)


def _build_in_child(
    load: Callable[[], Iterable[Any]],
    state: Callable[[], Any] | None,
    name: str,
    encoding: str,
    room_limit: int,
) -> tuple[int, dict[str, Any], Any]:
    """Run ``load`` in a short-lived forked child that writes the blob; returns a read-only fd, info, state.

    The loaded objects (and whatever the loader's heap holds) live and die in the child: this
    process, which will fork DataLoader workers, never holds them.
    """
    fd = _new_memfd(name)
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        try:
            pid = os.fork()
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(r)
                _die_with_parent()
                if os.getppid() != parent:  # it died before prctl took effect
                    os._exit(1)
                _collect_rarely()
                try:
                    info = _write(fd, load(), name, encoding, room_limit, hash_content=False)
                    result: tuple[str, Any] = ("ok", (info, state() if state is not None else None))
                except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
                    result = ("error", e)
                try:
                    payload = pickle.dumps(result, protocol=5)
                except Exception as e:  # noqa: BLE001 (an exception or state that does not pickle)
                    payload = pickle.dumps(("error", SharedListError(f"{type(e).__name__}: {e}")), protocol=5)
                with os.fdopen(w, "wb") as out:
                    out.write(payload)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            payload = pipe.read()
        _pid, status = os.waitpid(pid, 0)
        if not payload:
            how = (
                f"was killed by signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exited with status {os.waitstatus_to_exitcode(status)}"
            )
            msg = (
                f"SharedList {name!r}: the process loading it (pid {pid}) {how} before it finished"
                " (out of memory? see the kernel log: dmesg)"
            )
            raise SharedListError(msg)
        kind, value = pickle.loads(payload)
        if kind == "error":
            raise value
        info, loaded_state = value
    except BaseException:
        os.close(fd)
        raise
    return _seal(fd, name), info, loaded_state


def _store_over(fd: int, name: str) -> ObjectStore:
    """Map a received descriptor: O(1) if it is sealed (nobody can change it), else fully validated."""
    return ObjectStore(fd, f"SharedList {name!r}", not _core.memfd_sealed(fd))


class SharedList(Sequence[Any]):
    """A read-only list of Python objects held once per node in shared memory.

    In a job of several local processes (torchrun ranks: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, or
    torch.distributed), local rank 0 serializes ``objects`` once into sealed anonymous shared
    memory and every other local rank attaches to that copy instead of keeping its own. Reading
    an item decodes a fresh object; nothing shared is ever written, so fork's copy-on-write never
    copies it. It pickles as a small handle, so DataLoader workers (``fork``, ``spawn``,
    ``forkserver``) and ``multiprocessing`` children attach too. The memory is freed when the last
    process using it exits, however it exits: nothing is ever left in /dev/shm.

    Every local rank must create the same SharedLists in the same order (or pass the same
    ``name``) and pass equal lists: each rank hashes its own encoding of ``objects`` while local
    rank 0 builds, and a difference raises :class:`SharedListMismatchError`.

    Args:
        objects: The items: any iterable (read once) of picklable objects, such as a list of dicts.
        name: Tells lists of one job apart (default: the order of creation in this process).
        encoding: ``"pickle"`` (protocol 5, any picklable object) or ``"json"`` (JSON values only).
        timeout: Seconds a waiting rank waits for local rank 0 to start serving and to finish.
        check: Have every waiting rank compare its own list with local rank 0's.
        room_limit: Pretend at most this many bytes of memory are free (0: ask the kernel).
        mode: ``"auto"``: when an ``smstore serve`` daemon answers, local rank 0 hands it the copy
            it built, and first asks it for a copy of the same contents that another job already
            shared (then nothing is built; this costs one hashing pass over a sequence first);
            without a daemon, as ``"mmap"``, and says so as every reader does (see
            ``docs/daemon.md``, "Modes"). ``"daemon"``: the same, but a missing daemon is a
            :class:`DaemonError` naming the socket. ``"mmap"``: never ask a daemon; this node's
            own segment. ``"local"`` is a deprecated alias of ``"mmap"`` (it warns
            ``DeprecationWarning``). The other local ranks and the workers receive the copy from
            local rank 0 either way; the daemon holds a shared copy while any process is attached
            to it through the daemon, and lists it in ``smstore status``.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).

    Raises:
        PackInputError: An object cannot be encoded (its index and type are named).
        SharedMemoryError: The list will not fit in memory (the message gives the size and the fixes).
        SharedListError: Local rank 0 died, failed or did not serve it within ``timeout``.
        SharedListMismatchError: This rank's list differs from local rank 0's.

    Example:
        >>> annotations = SharedList(load_annotations())  # in every rank; one copy per node
        >>> annotations[17]["bbox"]
    """

    def __init__(
        self,
        objects: Iterable[Any],
        *,
        name: str | None = None,
        encoding: str = "pickle",
        timeout: float = 1800.0,
        check: bool = True,
        room_limit: int = 0,
        mode: Mode | Literal["local"] = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        self._open(objects, None, name, encoding, timeout, check, room_limit, _no_local(mode), socket)

    @classmethod
    def from_loader(
        cls,
        load: Callable[[], Iterable[Any]],
        *,
        key: str,
        state: Callable[[], Any] | None = None,
        name: str | None = None,
        encoding: str = "pickle",
        timeout: float = 1800.0,
        room_limit: int = 0,
        mode: Mode | Literal["local"] = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> SharedList:
        """A SharedList whose objects only one process per node ever holds: ``load()``'s, in a short-lived child.

        Local rank 0 forks a child that calls ``load()`` and streams its objects into the shared
        copy, then exits: the objects, and the heap that held them, never exist in a rank that
        forks DataLoader workers. The other local ranks call nothing; they attach. Instead of
        hashing lists, the ranks compare ``key``: a rank whose key differs from local rank 0's
        raises :class:`SharedListMismatchError`, and with a daemon the copy is shared under the key.

        Args:
            load: Returns the objects (any iterable, read once; a generator never holds them all).
                Called in a forked child of local rank 0 only.
            key: Names the contents: equal keys must mean equal lists (include a version, the
                source file's size and mtime, the parameters). :meth:`from_file` makes one for you.
            state: Called in the child after ``load()``; its result (picklable) is handed to every
                local rank as ``loader_state`` (e.g. the small tables a loader computes on the way).
            name, encoding, timeout, room_limit, mode, socket: As for :class:`SharedList`.

        Raises:
            SharedListError: The loading child died (killed, out of memory), or local rank 0 died
                or failed; the loader's own exception is raised as is in local rank 0.
            SharedListMismatchError: This rank's ``key`` differs from local rank 0's.
        """
        lst = cls.__new__(cls)
        lst._open(
            None, (load, key, state), name, encoding, timeout, True, room_limit, _no_local(mode), socket
        )
        return lst

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        parser: str | Callable[[str], Iterable[Any]] = "json",
        *,
        field: str | None = None,
        key: str | None = None,
        name: str | None = None,
        encoding: str = "pickle",
        timeout: float = 1800.0,
        room_limit: int = 0,
        mode: Mode | Literal["local"] = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> SharedList:
        """A SharedList of the objects in a file, parsed once per node (see :meth:`from_loader`).

        Args:
            path: The file.
            parser: ``"json"`` (a JSON array, or the array at ``field`` of a JSON object: COCO's
                ``field="annotations"`` or ``"images"``), ``"jsonl"`` (one JSON value per line,
                streamed), ``"pickle"`` (a pickled list; runs code: your own files only), or a
                function of the path returning the objects.
            field: With ``parser="json"``: the top-level key holding the array.
            key: Names the contents (default: the file's path, device, inode, size and mtime, the
                parser and ``field``: a changed file is a new key, never a stale copy).
            name, encoding, timeout, room_limit, mode, socket: As for :class:`SharedList`.
        """
        load = file_loader(path, parser, field)
        if key is None:
            how = parser if isinstance(parser, str) else f"{parser.__module__}.{parser.__qualname__}"
            key = file_key(path, how, field, encoding)
        return cls.from_loader(
            load,
            key=key,
            name=name,
            encoding=encoding,
            timeout=timeout,
            room_limit=room_limit,
            mode=_no_local(mode),
            socket=socket,
        )

    def _open(
        self,
        objects: Iterable[Any] | None,
        loader: tuple[Callable[[], Iterable[Any]], str, Callable[[], Any] | None] | None,
        name: str | None,
        encoding: str,
        timeout: float,
        check: bool,
        room_limit: int,
        mode: Mode,
        socket: str | os.PathLike[str] | None,
    ) -> None:
        """Build (local rank 0) or receive the shared copy of ``objects`` or of ``loader = (load, key, state)``."""
        mode = check_mode(mode)
        start = time.perf_counter()
        self.name = name if name is not None else f"list{next(_sequence)}"
        self._server: Server | None = None
        self._conn: Any = None  # our connection to the daemon, while it holds the copy for us
        # How the daemon took part: "attached" (it served this list already: nothing was built),
        # "shared" (built here and handed to it), or None.
        self.via_daemon: str | None = None
        self.loader_state: Any = None
        key = loader[1] if loader is not None else None
        topo = topology()
        role = topo.role
        if role in ("builder", "elect"):
            try:
                expected = topo.local_world_size - 1 if topo.local_world_size else None
                self._server = Server(address_for(self.name), self.name, expected, key)
                role = "builder"
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                if role == "builder":
                    msg = (
                        f"SharedList {self.name!r}: another process of this job already serves a list of "
                        "this name on this node; give each list its own name= (or set SMSTORE_JOB_ID per job)"
                    )
                    raise SharedListError(msg) from None
                role = "waiter"  # another rank won the election
        fd: int
        own: ContentHash | None = None
        if role == "waiter":
            deadline = time.monotonic() + timeout
            fd, info, own = self._receive(objects, encoding, deadline, check, key)
        else:
            try:
                if loader is not None:
                    fd, info = self._load_or_attach(loader, encoding, room_limit, mode, socket)
                else:
                    assert objects is not None
                    fd, info = self._from_daemon_or_build(objects, encoding, room_limit, mode, socket)
            except BaseException as e:
                if self._server is not None:
                    self._server.fail(f"{type(e).__name__}: {e}")
                raise
            if self._server is not None:
                self._server.publish(info, fd)
        if "state" in info:
            self.loader_state = pickle.loads(bytes.fromhex(info["state"]))
        try:
            self._bind(fd, _store_over(fd, self.name))
        except BaseException:
            os.close(fd)
            raise
        if own is not None and own.hexdigest() != info["content"]:
            assert objects is not None
            self._explain_mismatch(objects, own, info, topo.local_rank)
        self.role = role
        self.seconds = time.perf_counter() - start

    def _load_or_attach(
        self,
        loader: tuple[Callable[[], Iterable[Any]], str, Callable[[], Any] | None],
        encoding: str,
        room_limit: int,
        mode: Mode,
        sock: str | os.PathLike[str] | None,
    ) -> tuple[int, dict[str, Any]]:
        """Local rank 0 of the loader form: the daemon's copy under the key, else a child loads it."""
        from smstore.wire.client import attach_shared, keep_attached

        load, key, state = loader
        daemon = mode != "mmap" and self._daemon_answers(mode, sock)
        if daemon:
            found = attach_shared(daemon_key(key), sock)
            if found is not None:
                fd, reply, self._conn = found
                keep_attached(self)
                self.via_daemon = "attached"
                # The loader state is not the daemon's to keep: only lists without one are reused.
                if state is None:
                    return fd, {"key": key, "encoding": encoding, "content": reply.get("content", "")}
                os.close(fd)
                self._drop_connection()
                self.via_daemon = None
        fd, info, loaded_state = _build_in_child(load, state, self.name, encoding, room_limit)
        info["key"] = key
        if state is not None:
            info["state"] = pickle.dumps(loaded_state, protocol=5).hex()
        if daemon:
            self._share(fd, daemon_key(key), mode, sock)
        return fd, info

    def _from_daemon_or_build(
        self,
        objects: Iterable[Any],
        encoding: str,
        room_limit: int,
        mode: Mode,
        sock: str | os.PathLike[str] | None,
    ) -> tuple[int, dict[str, Any]]:
        """Local rank 0: a copy the daemon already serves, else a new one (handed to the daemon if any)."""
        from smstore.wire.client import attach_shared, keep_attached

        if mode == "mmap" or not self._daemon_answers(mode, sock):
            return _build(objects, self.name, encoding, room_limit)
        if isinstance(objects, Sequence):  # an iterator could be read only once: build it directly
            content = ContentHash()
            for record in encode_objects(objects, encoding):
                content.update(record)
            found = attach_shared(content.hexdigest(), sock)
            if found is not None:
                fd, _reply, self._conn = found
                keep_attached(self)
                self.via_daemon = "attached"
                return fd, {"content": content.hexdigest(), "encoding": encoding, "records": content.count}
        fd, info = _build(objects, self.name, encoding, room_limit)
        self._share(fd, info["content"], mode, sock)
        return fd, info

    def _daemon_answers(self, mode: Mode, sock: str | os.PathLike[str] | None) -> bool:
        """Whether a daemon answers (one round trip); without one, mode "daemon" raises."""
        from smstore.wire.client import daemon_request

        try:
            daemon_request({"op": "status"}, sock, timeout=5.0)
        except DaemonError as e:
            fall_back(mode, f"SharedList {self.name!r}", str(e), sock, "list")
            return False
        return True

    def _share(self, fd: int, key: str, mode: Mode, sock: str | os.PathLike[str] | None) -> None:
        """Hand the copy at ``fd`` to the daemon under ``key``; if it refuses, mode "daemon" raises."""
        from smstore.wire.client import keep_attached, share_with_daemon

        try:
            _reply, self._conn = share_with_daemon(fd, key, sock)
        except DaemonError as e:
            if mode == "daemon":
                os.close(fd)
            fall_back(mode, f"SharedList {self.name!r}", str(e), sock, "list")
            return
        keep_attached(self)
        self.via_daemon = "shared"

    def _drop_connection(self) -> None:
        """Leave the daemon's client list (close, and in forked children: the parent's stays)."""
        conn, self._conn = getattr(self, "_conn", None), None
        if conn is not None:
            conn.close()

    def _bind(self, fd: int, store: ObjectStore) -> None:
        self._fd = fd
        self._store = store
        self._closed = False

    def _receive(
        self, objects: Iterable[Any] | None, encoding: str, deadline: float, check: bool, key: str | None
    ) -> tuple[int, dict[str, Any], ContentHash | None]:
        peer: Peer = connect(address_for(self.name), self.name, deadline)
        try:
            self.builder_pid = peer.pid
            hello, _ = peer.receive(min(deadline, time.monotonic() + _HELLO_TIMEOUT), "answering")
            if key is not None:
                self._check_key(hello.get("key"), key, peer.pid)
            own = None
            if check and objects is not None:
                # Hash our own encoding while local rank 0 builds, and look for its death now and then.
                own = ContentHash()
                next_look = time.monotonic() + _ALIVE_EVERY
                for record in encode_objects(objects, encoding):
                    own.update(record)
                    if time.monotonic() >= next_look:
                        peer.check_alive()
                        next_look = time.monotonic() + _ALIVE_EVERY
            message, fd = peer.receive(deadline, "finishing the list")
        finally:
            peer.close()
        if not message.get("ok"):
            if fd is not None:
                os.close(fd)
            msg = f"SharedList {self.name!r}: local rank 0 (pid {peer.pid}) failed to build it: {message.get('message')}"
            raise SharedListError(msg)
        if fd is None:
            msg = f"SharedList {self.name!r}: local rank 0 (pid {peer.pid}) sent no descriptor"
            raise SharedListError(msg)
        if key is not None:
            try:
                self._check_key(message.get("key"), key, peer.pid)
            except SharedListMismatchError:
                if fd is not None:
                    os.close(fd)
                raise
        if check and message.get("encoding") != encoding:
            os.close(fd)
            msg = (
                f"SharedList {self.name!r}: local rank 0 (pid {peer.pid}) encoded it as "
                f"{message.get('encoding')!r}, this process as {encoding!r}"
            )
            raise SharedListMismatchError(msg)
        return fd, message, own

    def _check_key(self, theirs: str | None, key: str, pid: int) -> None:
        if theirs == key:
            return
        what = "a list with no key (SharedList(list))" if theirs is None else f"key {theirs!r}"
        msg = (
            f"SharedList {self.name!r}: local rank 0 (pid {pid}) loads {what}, this process asks for "
            f"key {key!r}: the ranks were given different sources, or the source file changed between them"
        )
        raise SharedListMismatchError(msg)

    def _explain_mismatch(
        self, objects: Iterable[Any], own: ContentHash, info: dict[str, Any], local_rank: int | None
    ) -> None:
        """Raise naming the first difference; return if the objects are equal all the same.

        Equal objects can encode differently (a set of strings iterates in a per-process order),
        so bytes that differ are compared again as objects before calling the lists different.
        """
        me = f"local rank {local_rank} (pid {os.getpid()})"
        them = f"local rank 0 (pid {getattr(self, 'builder_pid', '?')})"
        try:
            if own.count != len(self):
                msg = (
                    f"SharedList {self.name!r}: the local ranks passed different lists: {me} has "
                    f"{own.count} objects, {them} has {len(self)}"
                )
                raise SharedListMismatchError(msg)
            if isinstance(objects, Sequence):
                for i, (mine, theirs) in enumerate(zip(objects, self, strict=True)):
                    if mine != theirs:
                        msg = (
                            f"SharedList {self.name!r}: the local ranks passed different lists: object {i} "
                            f"is {_short(mine)} in {me} but {_short(theirs)} in {them}"
                        )
                        raise SharedListMismatchError(msg)
                return
            msg = (
                f"SharedList {self.name!r}: the local ranks passed different lists: {me} has content "
                f"{own.hexdigest()}, {them} has {info['content']}"
            )
            raise SharedListMismatchError(msg)
        except BaseException:
            self.close()
            raise

    # ---- the Sequence ----

    def __len__(self) -> int:
        return len(self._store)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        """Item ``index`` as a fresh object; a slice gives a list of fresh objects."""
        if isinstance(index, slice):
            return self._store.get_batch(list(range(*index.indices(len(self._store)))))
        return self._store[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._store)

    def raw(self, index: int) -> memoryview:
        """Item ``index`` undecoded: a zero-copy, read-only memoryview of its encoding."""
        return self._store.raw(index)

    @property
    def store(self) -> ObjectStore:
        """The :class:`smstore.ObjectStore` over the shared copy."""
        return self._store

    @property
    def nbytes(self) -> int:
        """Bytes of the shared copy (one per node)."""
        return self._store.file_size

    # ---- handles ----

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A handle, never the data: the receiver opens this process's descriptor through /proc.
        st = os.fstat(self._fd)
        return (_attach, (os.getpid(), self._fd, st.st_dev, st.st_ino, self._store.checksum, self.name))

    def close(self) -> None:
        """Drop this process's mapping and descriptor (objects already read stay valid)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._store.close()
        self._close_fd(self._fd)
        self._drop_connection()

    # Held by the class: a SharedList still alive at interpreter exit is closed by __del__ after
    # the module's globals (``os`` among them) may already be None.
    _close_fd = staticmethod(os.close)

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<SharedList {self.name!r} (closed)>"
        return f"<SharedList {self.name!r}: {len(self)} objects, {self.nbytes} bytes shared>"


def _no_local(mode: Mode | Literal["local"]) -> Mode:
    """``mode``, with the deprecated ``"local"`` read as ``"mmap"`` (warned, at the caller's caller)."""
    if mode == "local":
        msg = (
            "SharedList: mode='local' is deprecated; pass mode='mmap' (the same: this node's own copy, "
            "never a daemon)"
        )
        warnings.warn(msg, DeprecationWarning, stacklevel=3)
        return "mmap"
    return mode


def _short(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _attach(pid: int, fd_number: int, dev: int, ino: int, checksum: str, name: str) -> SharedList:
    """Unpickle a SharedList: open the sending process's descriptor of the same shared copy."""
    source = f"/proc/self/fd/{fd_number}" if pid == os.getpid() else f"/proc/{pid}/fd/{fd_number}"
    try:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        msg = (
            f"SharedList {name!r}: cannot open the shared copy held by process {pid} ({source}: "
            f"{e.strerror}); the process that pickled it must still be running (for DataLoader "
            "workers: the rank that owns the dataset), and /proc must allow it (same user, dumpable)"
        )
        raise SharedListError(msg) from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            msg = f"SharedList {name!r}: process {pid} no longer holds the shared copy (descriptor reused)"
            raise SharedListError(msg)
        store = _store_over(fd, name)
        if store.checksum != checksum:
            store.close()
            msg = f"SharedList {name!r}: the copy held by process {pid} is {store.checksum}, not {checksum}"
            raise SharedListError(msg)
    except BaseException:
        os.close(fd)
        raise
    lst = SharedList.__new__(SharedList)
    lst.name = name
    lst._server = None
    lst._conn = None
    lst.via_daemon = None
    lst.loader_state = None
    lst._bind(fd, store)
    lst.role = "attached"
    lst.seconds = 0.0
    return lst
