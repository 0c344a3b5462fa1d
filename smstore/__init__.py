"""smstore: a shared-memory sample store for PyTorch training.

Pack a dataset once into an offset-indexed blob; every DataLoader worker of every local rank then
reads zero-copy, read-only records from one copy per node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    from smstore import _core
except ImportError as err:  # pragma: no cover - only without a built extension
    raise ImportError(
        "smstore's compiled module smstore._core could not be imported. If you are running from a "
        "source checkout, install the package first (pip install .) and run outside the source tree."
    ) from err

from smstore._objects import ObjectStore, pack_objects
from smstore._pack import PackStats, Writer, pack
from smstore._packfiles import pack_files
from smstore._shards import ShardedObjectStore, ShardedStore, ShardedWriter, join
from smstore._store import Store, open
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

if TYPE_CHECKING:
    from smstore._arrays import pack_arrays, pack_npy_lines
    from smstore.client import DaemonStore, daemon_request, open_store
    from smstore.collate import TokenCollator
    from smstore.daemon.segments import collect_garbage, list_segments
    from smstore.dataset import SharedStoreDataset
    from smstore.loader import Loader
    from smstore.loader_stats import LoaderStats
    from smstore.mixture import Mixture, MixtureDataset, MixtureSampler, WindowedMixtureSampler
    from smstore.residency import ShardResidency
    from smstore.sampler import GlobalShuffleSampler, ResumableLoader, WindowedShuffleSampler
    from smstore.shared_list import SharedList
    from smstore.transform_loader import TransformLoader
    from smstore.views import Concat, Repeat, Subset, select

__version__: str = _core.__version__

__all__ = [
    "ChecksumMismatchError",
    "CollateError",
    "Concat",
    "DaemonError",
    "DaemonStore",
    "GlobalShuffleSampler",
    "IndexFileError",
    "IndexStaleError",
    "Loader",
    "LoaderStats",
    "Mixture",
    "MixtureDataset",
    "MixtureError",
    "MixtureSampler",
    "ObjectStore",
    "PackInputError",
    "PackStats",
    "RecordIndexError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteURLError",
    "Repeat",
    "ResumableLoader",
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
    "SharedStoreDataset": "smstore.dataset",
    "TokenCollator": "smstore.collate",
    "Loader": "smstore.loader",
    "LoaderStats": "smstore.loader_stats",
    "GlobalShuffleSampler": "smstore.sampler",
    "WindowedShuffleSampler": "smstore.sampler",
    "ResumableLoader": "smstore.sampler",
    "Mixture": "smstore.mixture",
    "MixtureDataset": "smstore.mixture",
    "MixtureSampler": "smstore.mixture",
    "WindowedMixtureSampler": "smstore.mixture",
    "ShardResidency": "smstore.residency",
    "pack_arrays": "smstore._arrays",
    "pack_npy_lines": "smstore._arrays",
    "open_store": "smstore.client",
    "DaemonStore": "smstore.client",
    "daemon_request": "smstore.client",
    "collect_garbage": "smstore.daemon.segments",
    "list_segments": "smstore.daemon.segments",
    "SharedList": "smstore.shared_list",
    "Subset": "smstore.views",
    "Repeat": "smstore.views",
    "Concat": "smstore.views",
    "select": "smstore.views",
    "TransformLoader": "smstore.transform_loader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'smstore' has no attribute {name!r}"
    raise AttributeError(msg)
