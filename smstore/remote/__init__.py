"""Object storage: URLs, fetching verified blobs, the node cache, uploads (docs/object_storage.md).

Needs the ``remote`` extra (``pip install "smstore[remote]"``): obstore reads, boto3 uploads to S3.
Neither is imported until a function that needs it runs.
"""

from __future__ import annotations

from smstore.remote.cache import CacheEntry, CacheStats, NodeCache
from smstore.remote.fetch import (
    DEFAULT_CHUNK,
    DEFAULT_CONCURRENCY,
    FetchResult,
    Retry,
    fetch,
    object_size,
    read_range,
)
from smstore.remote.upload import publish_remote_dataset, upload
from smstore.remote.urls import SCHEMES, RemoteURL, is_remote_url, parse_url

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_CONCURRENCY",
    "SCHEMES",
    "CacheEntry",
    "CacheStats",
    "FetchResult",
    "NodeCache",
    "RemoteURL",
    "Retry",
    "fetch",
    "is_remote_url",
    "object_size",
    "parse_url",
    "publish_remote_dataset",
    "read_range",
    "upload",
]
