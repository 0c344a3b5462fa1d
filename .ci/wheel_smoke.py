"""The smoke test of an installed wheel (.ci/wheel, cibuildwheel's test-command): run it outside the source tree.

It checks that the package imported is the installed one, then the CLI (`--version`, `pack`,
`verify`), `smstore.open` (byte-exact records), a daemon serving the blob on a socket in a temp dir
(`serve`, `status`, a read through it, `stop`), and with `--dataset` a SharedStoreDataset read
through a DataLoader with two worker processes (needs torch). Everything lives in one temp dir;
the daemon it starts is stopped, by its pid if `stop` fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import smstore

# Records that a text pack keeps byte for byte: an empty one, a `\r`, a NUL, UTF-8.
RECORDS = [f"record {i:03d}".encode() for i in range(200)] + [b"", b"tail\r", b"nul\x00byte", "ünï".encode()]


def cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    exe = Path(sys.executable).parent / "smstore"
    result = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise SystemExit(f"smstore {' '.join(map(str, args))} failed:\n{result.stdout}{result.stderr}")
    return result


def check_installed() -> None:
    where = Path(smstore.__file__).resolve().parent
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    if where.parent not in site:
        raise SystemExit(f"smstore was imported from {where}, not from this environment's site-packages")
    version = cli("--version").stdout.strip()
    if version != f"smstore {smstore.__version__}":
        raise SystemExit(f"smstore --version says {version!r}, the package {smstore.__version__}")
    print(f"wheel smoke: {version} from {where}")


def wait_loaded(daemon: subprocess.Popen[bytes], sock: Path, log: Path) -> dict[str, Any]:
    """The daemon's status once it answers with nothing loading (at most 30 s)."""
    for _ in range(300):
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited with {daemon.returncode}:\n{log.read_text()}")
        result = cli("status", "--json", "--socket", sock, check=False)
        if result.returncode == 0:
            status: dict[str, Any] = json.loads(result.stdout)
            if status["counts"]["segments"] == 1 and status["counts"]["loading"] == 0:
                return status
        time.sleep(0.1)
    raise SystemExit(f"the daemon did not load the blob in 30 s:\n{log.read_text()}")


def read_dataset(blob: Path, sock: Path) -> None:
    """Every record through a DataLoader with two workers, each attached to the daemon's segment."""
    from torch.utils.data import DataLoader

    ds = smstore.SharedStoreDataset(blob, decode="bytes", mode="daemon", socket=sock)
    loader = DataLoader(ds, batch_size=16, num_workers=2, collate_fn=list)
    got = [record for batch in loader for record in batch]
    if got != RECORDS:
        raise SystemExit("SharedStoreDataset read other records than were packed")
    print(f"wheel smoke: SharedStoreDataset read {len(got)} records through 2 DataLoader workers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", action="store_true", help="also read through SharedStoreDataset")
    args = parser.parse_args()
    check_installed()
    with tempfile.TemporaryDirectory(prefix="smstore-wheel-") as tmp:
        run = Path(tmp)
        text = run / "lines.txt"
        text.write_bytes(b"\n".join(RECORDS) + b"\n")
        blob = run / "data.smst"
        cli("pack", "-q", text, "-o", blob)
        with smstore.open(blob) as store:
            if [bytes(r) for r in store] != RECORDS:
                raise SystemExit("smstore.open read other records than were packed")
        cli("verify", blob)
        print(f"wheel smoke: pack, open and verify of {len(RECORDS)} records")

        sock = run / "daemon" / "smstore.sock"
        log = run / "daemon.log"
        with log.open("wb") as err:
            exe = Path(sys.executable).parent / "smstore"
            daemon = subprocess.Popen([exe, "serve", "--socket", sock, blob], stderr=err)
        try:
            status = wait_loaded(daemon, sock, log)
            (segment,) = status["segments"]
            if segment["records"] != len(RECORDS) or os.fspath(blob) not in segment["paths"]:
                raise SystemExit(f"the daemon's status does not describe the blob: {segment}")
            if args.dataset:
                read_dataset(blob, sock)
            cli("stop", "--socket", sock)
            daemon.wait(timeout=30)
            if daemon.returncode != 0 or sock.exists():
                raise SystemExit(f"the daemon exited with {daemon.returncode}:\n{log.read_text()}")
            print("wheel smoke: daemon serve, status and stop on a socket in a temp dir")
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
                cli("gc", "--socket", sock, check=False)
    print("wheel smoke: passed")


if __name__ == "__main__":
    main()
