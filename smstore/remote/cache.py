"""The node cache: blobs fetched from object storage kept on local disk, LRU within a byte limit."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from smstore import _core
from smstore.errors import StoreError, StoreFormatError, StoreIOError
from smstore.remote.fetch import DEFAULT_CHUNK, DEFAULT_CONCURRENCY, FetchResult, Retry, fetch
from smstore.remote.urls import RemoteURL, parse_url
from smstore.wire.ipc import untrusted_dir_fault
from smstore.wire.protocol import CHECKSUM_WORDING, is_checksum

__all__ = ["CacheEntry", "CacheStats", "NodeCache"]

_SUFFIX = ".smst"
_PART = ".part"
# The cache is private to its user: entries may hold data others may not read.
_DIR_MODE = 0o700
_FILE_MODE = 0o600
# Nothing in the cache is reached through a link, and no open waits on a FIFO planted there.
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

log = logging.getLogger("smstore")


@dataclass
class CacheStats:
    """What one NodeCache object did: entries served as they were, fetched, bytes fetched, retries."""

    hits: int = 0
    fetches: int = 0
    bytes_fetched: int = 0
    retries: int = 0


@dataclass(frozen=True)
class CacheEntry:
    """One blob in the cache: its file, size, and last use (``mtime``, nanoseconds)."""

    path: str
    size: int
    last_used_ns: int


class NodeCache:
    """Blobs fetched from object storage, kept in a directory, least recently used evicted first.

    An entry is a complete, verified blob named by its (url, checksum): it is fetched into an
    unnamed file (or a ``.part`` file where the file system has no ``O_TMPFILE``), its checksum
    checked, ``fsync``-ed and only then linked under its name. A process killed mid-fetch leaves no
    entry; a ``.part`` file of a dead process is removed by the next cache opened on the directory.
    Before an entry is used its size and its header (magic, file size, checksum) are checked
    against what the caller expects; an entry that fails is removed and fetched again.

    The cache is just its directory, so it survives restarts. Processes sharing it take a lock
    file: one lock for the entries (listing, eviction, recency), one per entry while it is fetched,
    so two processes asking for the same blob fetch it once (an evicted entry's lock file goes
    with it). The directories are made mode 0700 and the entries 0600: the cache is its user's.
    A directory of the cache that another user owns (root may) or may write, or that is a link, is
    refused as the daemon's socket directory is: whoever controls it could point eviction at any
    of this user's files. The directories are opened once and everything in them is reached
    through those descriptors, never through a link; anything there that is not a regular file
    is a bad entry. A cache this process may not write still serves its entries, without
    recording their use (one warning); fetching into it raises StoreIOError naming the directory.

    Args:
        directory: Where the entries live (created if missing).
        limit_bytes: The most the entries may hold together. Fetches in flight are not counted
            until they finish, then older entries are evicted until the limit holds again.

    Raises:
        StoreIOError: The directory cannot be made, or may not be trusted (naming it and why).
    """

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, not {limit_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.limit_bytes = limit_bytes
        self._entries = os.path.join(self.directory, "entries")
        self._locks = os.path.join(self.directory, "locks")
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._warned_read_only = False
        # Every name in the cache is resolved from these, never through a path a link could redirect.
        self._entries_fd = self._locks_fd = -1
        try:
            os.makedirs(os.path.dirname(self.directory), mode=_DIR_MODE, exist_ok=True)
        except OSError as e:
            raise StoreIOError(f"{self.directory}: cannot create the cache directory: {e.strerror}") from e
        try:
            top = self._open_dir(self.directory, None)
            try:
                self._entries_fd = self._open_dir(self._entries, top)
                self._locks_fd = self._open_dir(self._locks, top)
            finally:
                os.close(top)
            if all(os.access(".", os.W_OK, dir_fd=fd) for fd in (self._entries_fd, self._locks_fd)):
                with self._lock():
                    self._remove_dead_parts()
        except BaseException:
            self.close()
            raise

    def _open_dir(self, path: str, parent: int | None) -> int:
        """A descriptor of the cache's directory `path` (made if missing), once it is found trustworthy."""
        name = path if parent is None else os.path.basename(path)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, _DIR_MODE, dir_fd=parent)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                msg = f"{path}: a symbolic link or not a directory; refusing to use it for the node cache"
            else:
                msg = f"{path}: cannot create or open the node cache's directory: {e.strerror}"
            raise StoreIOError(msg) from e
        if (fault := untrusted_dir_fault(os.fstat(fd), root_owned_ok=True)) is not None:
            os.close(fd)
            msg = (
                f"{path}: {fault}; refusing to use it for the node cache (whoever controls it could make "
                "the cache remove or create your files): give a directory of your own, mode 0700"
            )
            raise StoreIOError(msg)
        return fd

    def close(self) -> None:
        """Close the cache's directories (paths and descriptors it handed out stay usable)."""
        fds = (self._entries_fd, self._locks_fd)
        self._entries_fd = self._locks_fd = -1  # a later use fails (EBADF), never reaches another file
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.close()

    def __repr__(self) -> str:
        return f"NodeCache({self.directory!r}, limit_bytes={self.limit_bytes})"

    @contextlib.contextmanager
    def _lock(self, name: str = "cache") -> Iterator[None]:
        fd = self._take_lock(name + ".lock", wait=True)
        assert fd is not None  # a waiting take returns a descriptor or raises
        try:
            yield
        finally:
            os.close(fd)  # releases the lock

    def _take_lock(self, name: str, *, wait: bool) -> int | None:
        """An fd holding the lock file `name` in locks/ (None if `wait` is False and another holds it)."""
        while True:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | _NOFOLLOW, _FILE_MODE, dir_fd=self._locks_fd)
            except OSError as e:
                msg = (
                    f"{self.directory}: cannot take the node cache's lock {os.path.join(self._locks, name)}: "
                    f"{e.strerror}; the cache directory must be writable by the user that fetches into it"
                )
                raise StoreIOError(msg) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            # An evicted entry's lock file is removed while held: if ours was, lock the new one.
            try:
                same = (
                    os.stat(name, dir_fd=self._locks_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                )
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    @staticmethod
    def _name(url: RemoteURL, checksum: str) -> str:
        where = hashlib.blake2b(str(url).encode(), digest_size=8).hexdigest()
        return f"{checksum}-{where}"

    def path_of(self, url: str | RemoteURL, checksum: str) -> str:
        """Where the entry of (url, checksum) lives, whether or not it is there."""
        u = url if isinstance(url, RemoteURL) else parse_url(url)
        return os.path.join(self._entries, self._name(u, checksum) + _SUFFIX)

    def entries(self) -> list[CacheEntry]:
        """The complete entries, least recently used first."""
        found = []
        with os.scandir(self._entries_fd) as it:
            for e in it:
                if not e.name.endswith(_SUFFIX):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append(CacheEntry(os.path.join(self._entries, e.name), st.st_size, st.st_mtime_ns))
        return sorted(found, key=lambda c: (c.last_used_ns, c.path))

    def total_bytes(self) -> int:
        """Bytes held by complete entries."""
        return sum(e.size for e in self.entries())

    def get(
        self,
        url: str | RemoteURL,
        *,
        checksum: str,
        size: int,
        chunk_size: int = DEFAULT_CHUNK,
        concurrency: int = DEFAULT_CONCURRENCY,
        retry: Retry | None = None,
        stop: threading.Event | None = None,
    ) -> str:
        """The path of a local, verified copy of the blob at `url`; fetched first if not cached.

        Args:
            url: The blob's URL.
            checksum: Its checksum (16 hex digits), as the manifest says.
            size: Its size in bytes, as the manifest says.
            chunk_size, concurrency, retry, stop: As :func:`smstore.remote.fetch`.

        Returns:
            The entry's path; it stays readable while open even if a later get evicts it. Another
            process may evict it before it is opened: :meth:`get_fd` hands over the entry open.

        Raises:
            StoreError: The blob is larger than the cache's limit.
            RemoteError, ChecksumMismatchError, ...: As :func:`smstore.remote.fetch`; nothing is cached then.
        """
        path, fd = self._get(url, checksum, size, chunk_size, concurrency, retry, stop)
        os.close(fd)
        return path

    def get_fd(
        self,
        url: str | RemoteURL,
        *,
        checksum: str,
        size: int,
        chunk_size: int = DEFAULT_CHUNK,
        concurrency: int = DEFAULT_CONCURRENCY,
        retry: Retry | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """:meth:`get`, the entry handed over open: a read-only descriptor (the caller's to close)
        of the very file that was verified, readable whatever another process evicts meanwhile.

        Args and Raises: as :meth:`get`.
        """
        return self._get(url, checksum, size, chunk_size, concurrency, retry, stop)[1]

    def _get(
        self,
        url: str | RemoteURL,
        checksum: str,
        size: int,
        chunk_size: int,
        concurrency: int,
        retry: Retry | None,
        stop: threading.Event | None,
    ) -> tuple[str, int]:
        """The entry's path and a read-only descriptor of the file verified (or fetched) as it."""
        u = url if isinstance(url, RemoteURL) else parse_url(url)
        if not is_checksum(checksum):
            raise ValueError(f"{u}: checksum must be {CHECKSUM_WORDING}, not {checksum!r}")
        if size > self.limit_bytes:
            raise StoreError(
                f"{u}: a blob of {size} bytes does not fit the node cache's limit of {self.limit_bytes} bytes "
                f"({self.directory}); raise the limit"
            )
        path = self.path_of(u, checksum)
        if (fd := self._open_usable(path, size, checksum)) is not None:
            self._count(hits=1)
            return path, fd
        with self._lock("entry-" + self._name(u, checksum)):
            # Another process fetched it while we waited?
            if (fd := self._open_usable(path, size, checksum)) is not None:
                self._count(hits=1)
                return path, fd
            with self._lock():
                self._evict(self.limit_bytes - size, keep=path)
            result, fd = self._fetch_into_entry(u, path, size, checksum, chunk_size, concurrency, retry, stop)
            try:
                self._count(fetches=1, bytes_fetched=result.bytes, retries=result.retries)
                with self._lock():
                    self._evict(self.limit_bytes, keep=path)
            except BaseException:
                os.close(fd)
                raise
            return path, fd

    def drop(self, url: str | RemoteURL, checksum: str, fd: int) -> None:
        """Remove the entry of (url, checksum) if it is still the file `fd` (from :meth:`get_fd`).

        For a caller that found the entry's records corrupt: the cache checks an entry's size and
        header before each use, not every byte (a disk that rots a record leaves the header whole).
        The next get fetches it again. An entry fetched anew meanwhile is another file: kept.

        Raises:
            StoreIOError: The cache is not writable by this process.
        """
        u = url if isinstance(url, RemoteURL) else parse_url(url)
        name = self._name(u, checksum)
        with self._lock("entry-" + name):  # no fetch renames a new entry in meanwhile
            try:
                there = os.stat(name + _SUFFIX, dir_fd=self._entries_fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            mine = os.fstat(fd)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                self._unlink(name + _SUFFIX)

    def _count(self, **add: int) -> None:
        with self._stats_lock:
            for k, v in add.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _open_usable(self, path: str, size: int, checksum: str) -> int | None:
        """A read-only descriptor of the entry at `path`, if it is there and its size and header
        say it is the blob asked for (None if not): the file checked is the file handed over.

        A present entry that does not match is removed (a disk fault, or a hand-edited cache), as
        is anything there that is not a regular file (a link, a FIFO: opened, it would block).
        """
        name = os.path.basename(path)
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=self._entries_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENXIO):  # a link; a socket
                raise StoreIOError(f"{path}: cannot open the node cache's entry: {e.strerror}") from e
            self._unlink(path)
            return None
        try:
            good = False
            if stat.S_ISREG(os.fstat(fd).st_mode):
                header = _core.read_header_fd(fd, path)  # the format's own checks, file size included
                good = header.file_size == size and header.checksum == checksum
        except StoreFormatError:
            good = False
        except BaseException:
            os.close(fd)
            raise
        if not good:
            os.close(fd)
            self._unlink(path)
            return None
        try:
            os.utime(fd, ns=(time.time_ns(), time.time_ns()))  # the recency LRU orders by
        except FileNotFoundError:
            pass
        except OSError as e:  # a cache this process may not write: serve it, unordered
            if not self._warned_read_only:
                self._warned_read_only = True
                log.warning(
                    "%s: cannot record the use of %s (%s): the node cache is not writable by this "
                    "process, so its least recently used order is not kept",
                    self.directory,
                    os.path.basename(path),
                    e.strerror,
                )
        return fd

    def _unlink(self, path: str) -> None:
        """Remove the entry (or ``.part`` file) at `path` from entries/ (a link there, not its target)."""
        try:
            os.unlink(os.path.basename(path), dir_fd=self._entries_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            msg = f"{self.directory}: cannot remove the node cache's entry {path}: {e.strerror}"
            raise StoreIOError(msg) from e

    def _fetch_into_entry(
        self,
        url: RemoteURL,
        path: str,
        size: int,
        checksum: str,
        chunk_size: int,
        concurrency: int,
        retry: Retry | None,
        stop: threading.Event | None,
    ) -> tuple[FetchResult, int]:
        """Fetch into a new entry at `path`; the result and a read-only descriptor of the entry."""
        name = os.path.basename(path)
        part: str | None = None  # its name in entries/
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, _FILE_MODE, dir_fd=self._entries_fd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise StoreIOError(f"{self._entries}: cannot create a file: {e.strerror}") from e
            part = f"{name}.{os.getpid()}.{os.urandom(4).hex()}{_PART}"
            fd = os.open(
                part, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, _FILE_MODE, dir_fd=self._entries_fd
            )
        try:
            os.ftruncate(fd, size)
            result = fetch(
                url,
                fd,
                size=size,
                checksum=checksum,
                chunk_size=chunk_size,
                concurrency=concurrency,
                retry=retry,
                stop=stop,
            )
            os.fsync(fd)
            if part is None:
                # An unnamed file gets a temporary name, then the entry's name by rename (atomic).
                part = f"{name}.{os.getpid()}.{os.urandom(4).hex()}{_PART}"
                _link_unnamed(fd, self._entries_fd, part)
            os.rename(part, name, src_dir_fd=self._entries_fd, dst_dir_fd=self._entries_fd)
            part = None
            os.fsync(self._entries_fd)
            # The file just verified, reopened read-only (not by its name: it may be evicted already).
            return result, os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
            if part is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part, dir_fd=self._entries_fd)

    def _evict(self, room: int, *, keep: str) -> None:
        """Remove least recently used entries (never `keep`) until the rest hold at most `room` bytes."""
        entries = self.entries()
        total = sum(e.size for e in entries if e.path != keep)
        for e in entries:
            if total <= room:
                break
            if e.path == keep:
                continue
            self._unlink(e.path)  # a process reading it keeps its open file
            total -= e.size
            self._remove_entry_lock(os.path.basename(e.path).removesuffix(_SUFFIX))

    def _remove_entry_lock(self, name: str) -> None:
        """Remove an evicted entry's lock file, unless a process holds it (it is fetching again)."""
        lock = f"entry-{name}.lock"
        try:
            os.stat(lock, dir_fd=self._locks_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        fd = self._take_lock(lock, wait=False)
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(
                    lock, dir_fd=self._locks_fd
                )  # while held: a waiter then sees its file gone and locks a new one
        finally:
            os.close(fd)

    def _remove_dead_parts(self) -> None:
        """Remove the ``.part`` files of processes that no longer run (killed mid-fetch)."""
        with os.scandir(self._entries_fd) as it:
            for e in it:
                if not e.name.endswith(_PART):
                    continue
                try:
                    pid = int(e.name.rsplit(".", 3)[-3])
                except (ValueError, IndexError):
                    pid = -1
                if pid > 0 and _alive(pid):
                    continue
                self._unlink(e.name)


def _link_unnamed(fd: int, dir_fd: int, name: str) -> None:
    """Give the ``O_TMPFILE`` file `fd` the name `name` in the directory `dir_fd`.

    ``linkat`` must follow /proc/self/fd's link: os.link does so only when given a directory fd
    (with none it calls ``link``, which links the magic link itself and fails with EXDEV).
    """
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), name, src_dir_fd=proc, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(proc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
