"""smstore's exception hierarchy: everything smstore raises for bad input derives from StoreError."""

from __future__ import annotations

__all__ = [
    "ChecksumMismatchError",
    "CollateError",
    "DaemonError",
    "IndexFileError",
    "IndexStaleError",
    "MixtureError",
    "PackInputError",
    "RecordIndexError",
    "RemoteError",
    "RemoteNeedsDaemonError",
    "RemoteNotFoundError",
    "RemoteURLError",
    "SharedListError",
    "SharedListMismatchError",
    "SharedMemoryError",
    "StoreChangedError",
    "StoreClosedError",
    "StoreError",
    "StoreFormatError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreTruncatedError",
    "StoreVersionError",
    "WorkerError",
]


class StoreError(Exception):
    """Base class of every error smstore raises about stores, inputs and the daemon."""


class StoreFormatError(StoreError, ValueError):
    """The file is not a valid smstore blob: foreign, malformed or corrupt."""


class StoreTruncatedError(StoreFormatError):
    """The file is shorter than its header says: an incomplete copy or download."""


class StoreVersionError(StoreFormatError):
    """The blob uses a format version or feature this smstore cannot read."""


class ChecksumMismatchError(StoreFormatError):
    """The stored checksum does not match the file's contents."""


class StoreClosedError(StoreError, ValueError):
    """The object was closed (a Store after close(), a Writer after finish or abort) or never initialized."""


class RecordIndexError(StoreError, IndexError):
    """A record index outside the store (a sampler or index list made for another dataset)."""


class StoreChangedError(StoreError):
    """The file was replaced since a dataset was created: a process would read other data."""


class StoreIOError(StoreError, OSError):
    """An operating-system call on a store or input file failed."""


class StoreNotFoundError(StoreIOError, FileNotFoundError):
    """The store or input file does not exist."""


class PackInputError(StoreError, ValueError):
    """Input given to pack is invalid (for example a line that is not JSON)."""


class SharedMemoryError(StoreError):
    """A shared-memory segment could not be created, sized or mapped."""


class SharedListError(SharedMemoryError):
    """A SharedList could not be built, handed over or attached (e.g. its builder died)."""


class SharedListMismatchError(SharedListError, ValueError):
    """Local ranks passed different lists to the same SharedList."""


class CollateError(StoreError, TypeError):
    """Records that torch's default collate_fn would batch wrongly, or not at all: pass decode= or a collate_fn."""


class DaemonError(StoreError):
    """The smstore daemon is not running, refused a request, or failed."""


class RemoteNeedsDaemonError(DaemonError):
    """An object in object storage reached without the node daemon, the only process that fetches
    one: the message names the object and says to start ``smstore serve``."""


class MixtureError(StoreError, ValueError):
    """A mixture that cannot be built (bad weights, empty sources), or a state saved for another mixture."""


class IndexFileError(StoreFormatError):
    """A view's index file (see smstore.read.views.select) is malformed: truncated, foreign or out of range."""


class IndexStaleError(StoreChangedError):
    """A view's index file was made over other data: the data changed since it was selected."""


class WorkerError(StoreError, RuntimeError):
    """A TransformLoader worker failed: its transform raised (the message holds its traceback), or it died."""


class RemoteURLError(StoreError, ValueError):
    """A URL smstore will not use: a scheme off the allow-list (s3, gs, az, https), userinfo, a query, bad characters."""


class RemoteError(StoreIOError):
    """Object storage refused or failed a request (after the retries a retryable error gets); names the object."""


class RemoteNotFoundError(RemoteError, StoreNotFoundError):
    """The object (or its bucket) does not exist."""
