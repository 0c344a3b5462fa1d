"""smstore: a shared-memory sample store for PyTorch training.

Pack a dataset once into an offset-indexed blob; every DataLoader worker of every local rank then
reads zero-copy, read-only records from one copy per node.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

try:
    from smstore import _core
except ImportError as err:  # pragma: no cover - only without a built extension
    raise ImportError(
        "smstore's compiled module smstore._core could not be imported. If you are running from a "
        "source checkout, install the package first (pip install .) and run outside the source tree."
    ) from err

from smstore.errors import (
    ChecksumMismatchError,
    CollateError,
    DaemonError,
    IndexFileError,
    IndexStaleError,
    MixtureError,
    PackInputError,
    RecordIndexError,
    RemoteError,
    RemoteNeedsDaemonError,
    RemoteNotFoundError,
    RemoteURLError,
    SharedListError,
    SharedListMismatchError,
    SharedMemoryError,
    StoreChangedError,
    StoreClosedError,
    StoreError,
    StoreFormatError,
    StoreIOError,
    StoreNotFoundError,
    StoreTruncatedError,
    StoreVersionError,
    WorkerError,
)
from smstore.format.manifest import source_of
from smstore.format.objects import ObjectStore, pack_objects
from smstore.read.shards import ShardedObjectStore, ShardedStore, ShardedWriter, join
from smstore.read.store import Store
from smstore.read.store import open as _open_local
from smstore.wire import fork as _fork  # noqa: F401 (a forked child inherits a frozen heap: smstore/wire/fork.py)
from smstore.write.pack import PackStats, Writer, pack
from smstore.write.packfiles import pack_files

if TYPE_CHECKING:
    from smstore.daemon.segments import collect_garbage, list_segments
    from smstore.loading.collate import TokenCollator
    from smstore.loading.decoded_cache import DecodedCache
    from smstore.loading.loader import Loader
    from smstore.loading.stats import LoaderStats
    from smstore.loading.transform_loader import TransformLoader
    from smstore.read.dataset import SharedStoreDataset
    from smstore.read.packing import PackedBins
    from smstore.read.shared_list import SharedList
    from smstore.read.tokens import TokenWindows
    from smstore.read.views import Concat, Repeat, Subset, select
    from smstore.sampling import (
        BlockWindowSampler,
        GlobalShuffleSampler,
        Mixture,
        MixtureDataset,
        MixtureSampler,
        MixtureSchedule,
        ResumableLoader,
        ScheduledMixtureDataset,
        WindowedMixtureSampler,
        WindowedShuffleSampler,
    )
    from smstore.wire.client import DaemonStore, daemon_request, open_store
    from smstore.wire.residency import Residency, ShardResidency
    from smstore.write.arrays import pack_arrays, pack_npy_lines

__version__: str = _core.__version__

__all__ = [
    "BlockWindowSampler",
    "ChecksumMismatchError",
    "CollateError",
    "Concat",
    "DaemonError",
    "DaemonStore",
    "DecodedCache",
    "GlobalShuffleSampler",
    "IndexFileError",
    "IndexStaleError",
    "Loader",
    "LoaderStats",
    "Mixture",
    "MixtureDataset",
    "MixtureError",
    "MixtureSampler",
    "MixtureSchedule",
    "ObjectStore",
    "PackInputError",
    "PackStats",
    "PackedBins",
    "RecordIndexError",
    "RemoteError",
    "RemoteNeedsDaemonError",
    "RemoteNotFoundError",
    "RemoteURLError",
    "Repeat",
    "Residency",
    "ResumableLoader",
    "ScheduledMixtureDataset",
    "ShardResidency",
    "ShardedObjectStore",
    "ShardedStore",
    "ShardedWriter",
    "SharedList",
    "SharedListError",
    "SharedListMismatchError",
    "SharedMemoryError",
    "SharedStoreDataset",
    "Store",
    "StoreChangedError",
    "StoreClosedError",
    "StoreError",
    "StoreFormatError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreTruncatedError",
    "StoreVersionError",
    "Subset",
    "TokenCollator",
    "TokenWindows",
    "TransformLoader",
    "WindowedMixtureSampler",
    "WindowedShuffleSampler",
    "WorkerError",
    "Writer",
    "__version__",
    "collect_garbage",
    "daemon_request",
    "join",
    "list_segments",
    "open",
    "open_store",
    "pack",
    "pack_arrays",
    "pack_files",
    "pack_npy_lines",
    "pack_objects",
    "select",
]

# These load on first use: `import smstore` (the CLI, the daemon) never imports torch, and numpy
# only when something needs it, so that commands start fast; nor does a reader import the daemon.
_LAZY = {
    "SharedStoreDataset": "smstore.read.dataset",
    "TokenCollator": "smstore.loading.collate",
    "Loader": "smstore.loading.loader",
    "LoaderStats": "smstore.loading.stats",
    "GlobalShuffleSampler": "smstore.sampling",
    "WindowedShuffleSampler": "smstore.sampling",
    "BlockWindowSampler": "smstore.sampling",
    "ResumableLoader": "smstore.sampling",
    "Mixture": "smstore.sampling",
    "MixtureDataset": "smstore.sampling",
    "MixtureSampler": "smstore.sampling",
    "MixtureSchedule": "smstore.sampling",
    "ScheduledMixtureDataset": "smstore.sampling",
    "WindowedMixtureSampler": "smstore.sampling",
    "Residency": "smstore.wire.residency",
    "ShardResidency": "smstore.wire.residency",
    "pack_arrays": "smstore.write.arrays",
    "pack_npy_lines": "smstore.write.arrays",
    "open_store": "smstore.wire.client",
    "DaemonStore": "smstore.wire.client",
    "daemon_request": "smstore.wire.client",
    "collect_garbage": "smstore.daemon.segments",
    "list_segments": "smstore.daemon.segments",
    "SharedList": "smstore.read.shared_list",
    "Subset": "smstore.read.views",
    "Repeat": "smstore.read.views",
    "Concat": "smstore.read.views",
    "TokenWindows": "smstore.read.tokens",
    "PackedBins": "smstore.read.packing",
    "select": "smstore.read.views",
    "TransformLoader": "smstore.loading.transform_loader",
    "DecodedCache": "smstore.loading.decoded_cache",
}


def open(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    raw: bool = False,
    socket: str | os.PathLike[str] | None = None,
) -> Store | ShardedStore:
    """Open a blob or a sharded dataset, on disk or in object storage, and validate its structure.

    A local file maps read-only (see :func:`smstore.read.store.open`): a blob of objects (see
    :func:`smstore.pack_objects`) opens as an :class:`ObjectStore`, whose items are decoded
    objects (unpickling a pickle record runs code from the file); with ``raw``, or through
    ``smstore.Store(path)``, its records are raw bytes. A sharded dataset (a manifest, or a
    directory holding ``manifest.json``) opens as a :class:`ShardedStore` (a
    ``ShardedObjectStore`` for objects, unless ``raw``), one global index over its shards.
    Opening, ``len``, ``metadata``, ``verify`` and ``repr`` never decode a record.

    A URL (``s3://bucket/ds/``, ``gs://``, ``az://``, ``https://``) is read through the node's
    daemon (``smstore serve``), the only process that fetches from object storage
    (:func:`smstore.wire.client.open_url`): a dataset's shards as samplers hold them (or for this
    reader), one blob once loaded (``smstore load URL``).

    Args:
        path: The ``.smst`` file, a sharded dataset, or the URL of either.
        verify: Also check the checksum over the whole file (reads every byte; every shard).
        raw: Give every record as a read-only memoryview of its bytes, never decoded: what a
            program that only inspects a file it does not trust should use.
        socket: The daemon's socket for a URL (default: ``$SMSTORE_SOCKET``, else the per-user default).

    Raises:
        StoreNotFoundError: The file does not exist (``RemoteNotFoundError``: the object).
        StoreFormatError: The file is foreign, malformed, truncated, or fails ``verify``.
        RemoteNeedsDaemonError: A URL, and no daemon answers (only the daemon fetches from object storage).
        DaemonError: The daemon does not serve the blob at a URL.
    """
    if source_of(path).remote:
        from smstore.wire.client import open_url

        return open_url(os.fspath(path), verify=verify, raw=raw, socket=socket)
    return _open_local(path, verify=verify, raw=raw)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'smstore' has no attribute {name!r}"
    raise AttributeError(msg)
