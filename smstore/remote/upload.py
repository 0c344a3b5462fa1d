"""Uploading blobs and sharded datasets to object storage: multipart, aborted on failure, manifest last."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from smstore import _core
from smstore.errors import RemoteError, RemoteURLError, StoreChangedError, StoreIOError, StoreNotFoundError
from smstore.remote.urls import RemoteURL, parse_url

__all__ = ["DEFAULT_PART", "publish_remote_dataset", "upload"]

log = logging.getLogger("smstore.remote")

DEFAULT_PART = 16 << 20  # S3 allows 5 MiB to 5 GiB per part and 10,000 parts: 16 MiB parts reach 156 GiB
MIN_PART = 5 << 20
MAX_PARTS = 10_000


def _s3_client() -> Any:
    """A boto3 S3 client configured from the standard AWS environment and config files."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 8}))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def upload(
    local_path: str | os.PathLike[str],
    url: str | RemoteURL,
    *,
    part_size: int = DEFAULT_PART,
    on_part: Callable[[int, int], None] | None = None,
) -> None:
    """Upload the file at `local_path` to the object `url` (``s3://`` only, for now).

    A file larger than `part_size` goes up as a multipart upload. If anything fails or interrupts
    it (an error, ``KeyboardInterrupt``, an exception raised by `on_part`), the multipart upload is
    aborted before the exception propagates, so no parts are left behind to be billed; only a
    ``kill -9`` can leave one (a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` removes
    those). The object appears only when the upload completes, whole.

    Args:
        local_path: The file.
        url: Where it goes: ``s3://bucket/key``.
        part_size: Bytes per part (at least 5 MiB, as S3 requires; raised if the file would need
            more than 10,000 parts).
        on_part: Called as ``on_part(parts_done, parts_total)`` after each part.

    Raises:
        RemoteURLError: A URL smstore will not use, or a scheme other than ``s3://``.
        StoreNotFoundError: `local_path` does not exist.
        RemoteError: The upload failed (after botocore's retries of retryable errors).
    """
    u = url if isinstance(url, RemoteURL) else parse_url(url)
    if u.scheme != "s3":
        raise RemoteURLError(
            f"{u}: upload writes to s3:// only for now (gs://, az:// and https:// are read-only)"
        )
    path = os.fspath(local_path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError as e:
        raise StoreNotFoundError(f"{path}: no such file to upload") from e
    except OSError as e:
        raise StoreIOError(f"{path}: {e.strerror}") from e
    part_size = max(part_size, MIN_PART, -(-size // MAX_PARTS))
    client = _s3_client()
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if size <= part_size:
            with open(path, "rb") as f:
                client.put_object(Bucket=u.bucket, Key=u.key, Body=f)
            if on_part is not None:
                on_part(1, 1)
            return
        _multipart(client, path, size, u, part_size, on_part)
    except (BotoCoreError, ClientError) as e:
        raise RemoteError(f"{u}: upload of {path} failed: {_why(e)}") from e


def _multipart(
    client: Any,
    path: str,
    size: int,
    u: RemoteURL,
    part_size: int,
    on_part: Callable[[int, int], None] | None,
) -> None:
    upload_id = client.create_multipart_upload(Bucket=u.bucket, Key=u.key)["UploadId"]
    total = -(-size // part_size)
    try:
        parts = []
        with open(path, "rb") as f:
            for n in range(1, total + 1):
                body = f.read(part_size)
                reply = client.upload_part(
                    Bucket=u.bucket, Key=u.key, UploadId=upload_id, PartNumber=n, Body=body
                )
                parts.append({"PartNumber": n, "ETag": reply["ETag"]})
                if on_part is not None:
                    on_part(n, total)
        client.complete_multipart_upload(
            Bucket=u.bucket, Key=u.key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client.abort_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=upload_id)
        except (
            BotoCoreError,
            ClientError,
        ) as e:  # the first failure is the one to report; say the parts may remain
            log.error(
                "%s: aborting multipart upload %s failed too (%s); parts may remain", u, upload_id, _why(e)
            )
        raise


def publish_remote_dataset(
    local_dir: str | os.PathLike[str], url: str | RemoteURL, *, part_size: int = DEFAULT_PART
) -> str:
    """Upload a sharded dataset (a directory with ``manifest.json``) under the prefix `url`.

    The shards go up first, each whole (see :func:`upload`), and the manifest last: a reader that
    finds the manifest finds every shard it names. Shards keep their paths relative to the
    manifest, so the uploaded manifest is the local one, byte for byte.

    Args:
        local_dir: The dataset directory (or its manifest file).
        url: The prefix, ``s3://bucket/path/`` (a missing trailing ``/`` is added).
        part_size: As :func:`upload`.

    Returns:
        The manifest's URL.

    Raises:
        StoreFormatError: The manifest is invalid, or names a shard outside its directory.
        RemoteURLError, RemoteError: As :func:`upload`.
    """
    from smstore.format.manifest import MANIFEST_NAME, read_manifest  # _manifest imports this package

    manifest = read_manifest(local_dir)
    prefix = url if isinstance(url, RemoteURL) else parse_url(url, prefix=True)
    if prefix.key and not prefix.key.endswith("/"):
        prefix = parse_url(str(prefix), prefix=True)
    targets = []
    for k, shard in enumerate(manifest.shards):
        if os.path.isabs(shard.path) or shard.path.split("/")[0] == "..":
            raise RemoteURLError(
                f"{manifest.path}: shard {k} ({shard.path}) lies outside the dataset's directory; "
                "re-pack or join the dataset into one directory before publishing it"
            )
        local = manifest.shard_path(k)
        if _core.peek_checksum(local) != shard.checksum:
            raise StoreChangedError(
                f"{local}: its header's checksum is not the manifest's {shard.checksum} (shard {k}): "
                "the shard was replaced since the manifest was written; re-pack the dataset"
            )
        targets.append((local, prefix.join(shard.path)))
    manifest_url = prefix.join(MANIFEST_NAME)
    for local, remote in targets:
        upload(local, remote, part_size=part_size)
    upload(manifest.path, manifest_url, part_size=part_size)
    return str(manifest_url)
