"""Manifests in object storage: each fetched on a thread of its own (never on the event loop), the requests naming it waiting."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from smstore.format.manifest import Manifest, read_manifest

__all__ = ["ManifestFetches"]

# A request waiting for a manifest: its connection and the request itself (served once it is in).
Waiting = tuple[int, dict[str, Any]]


class ManifestFetches:
    """The manifests being fetched, and the requests that wait for each.

    The owner's ``hold`` naming a dataset URL the daemon has no manifest for
    queues its request here (its connection set busy, so its later requests wait in order); one
    thread per URL reads the manifest (``read_manifest``: the scheme allow-list, one GET, the full
    validation) and wakes the event loop, which keeps it and serves the waiting requests again.

    Args:
        wake: Wakes the event loop (called from the fetching thread).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.waiting: dict[str, list[Waiting]] = {}
        self._done: queue.Queue[tuple[str, Manifest | Exception]] = queue.Queue()

    def fetch(self, url: str, cid: int, req: dict[str, Any]) -> None:
        """Serve `req` of connection `cid` again once the manifest at `url` is fetched (or failed)."""
        first = url not in self.waiting
        self.waiting.setdefault(url, []).append((cid, req))
        if first:
            threading.Thread(target=self._run, args=(url,), name="smstore-manifest", daemon=True).start()

    def _run(self, url: str) -> None:
        result: Manifest | Exception
        try:
            result = read_manifest(url)
        except Exception as e:  # noqa: BLE001 - every fetch gets an answer: the waiting requests hear it
            result = e
        self._done.put((url, result))
        self._wake()

    def finished(self) -> Iterator[tuple[str, Manifest | Exception, list[Waiting]]]:
        """The fetches ended since the last call: the URL, the manifest (or why not), the requests waiting."""
        while True:
            try:
                url, result = self._done.get_nowait()
            except queue.Empty:
                return
            yield url, result, self.waiting.pop(url, [])
