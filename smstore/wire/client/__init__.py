"""The client of the node daemon: ``open_store`` (the daemon's copy of a blob, else a mapping of
the file), ``StoreHandle``, and the daemon connections behind them (``session.py``)."""

from __future__ import annotations

from smstore.read.modes import Mode
from smstore.wire.client.opening import Preattacher, StoreHandle, open_store, open_url
from smstore.wire.client.session import (
    LOAD_WAIT,
    DaemonObjectStore,
    DaemonSession,
    DaemonStore,
    attach_shared,
    daemon_request,
    keep_attached,
    session_for,
    share_with_daemon,
)

__all__ = [
    "LOAD_WAIT",
    "DaemonObjectStore",
    "DaemonSession",
    "DaemonStore",
    "Mode",
    "Preattacher",
    "StoreHandle",
    "attach_shared",
    "daemon_request",
    "keep_attached",
    "open_store",
    "open_url",
    "session_for",
    "share_with_daemon",
]
