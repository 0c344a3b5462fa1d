"""smstore.remote.fetch against the client library's own plain download of the same object.

The server is, by default, benchmarks/_s3limit.py: an S3 GET/HEAD server that reads only the range
asked for and, like real S3, limits each connection's bandwidth (``--conn-rate``, default 150 MB/s;
AWS quotes ~100-200 MB/s per connection) and waits ``--latency`` (default 20 ms) before a response's
first byte. ``--server moto`` runs moto's server in its own process instead (it re-reads the whole
object for every ranged GET, so it punishes exactly what real S3 rewards). One blob of ~256 MiB
is put in it. Each round downloads it, interleaved: obstore's plain ``get`` (one GET, the bytes into memory: the
baseline), ``smstore.remote.fetch`` (parallel ranged GETs into a buffer, XXH64 verified), the same
into a NodeCache entry (a file, fsync-ed), and for reference boto3's ``get_object`` and s3fs's
``cat_file`` (when installed). The best round of each counts. Goal: fetch >= 0.9x the baseline.

    python benchmarks/bench_remote.py                 # ~256 MiB, 3 rounds: results/remote.md
    python benchmarks/bench_remote.py --server moto --out /tmp/remote-moto.md     # moto's server
    python benchmarks/bench_remote.py --mib 64 --rounds 2 --out /tmp/remote.md    # a quick look
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_core import Report, command_line, log, machine_info, temp_dir, write_results

import smstore
from smstore import _core
from smstore.remote import DEFAULT_CHUNK, DEFAULT_CONCURRENCY, NodeCache, fetch

BUCKET = "smstore-bench"
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("moto's server did not start (pip install 'moto[server]')") from None
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not answer within 30 s")


def make_blob(path: Path, mib: int) -> None:
    record = 1 << 20
    with smstore.Writer(path) as w:
        for _ in range(mib):
            w.append(os.urandom(record))


def mibs(rate: float) -> str:
    return f"{rate / 2**20:.0f} MiB/s"


def rate(run: Callable[[], int]) -> float:
    t = time.perf_counter()
    n = run()
    return n / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="blob size in MiB (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "remote.md")
    ap.add_argument("--server", choices=["s3limit", "moto"], default="s3limit")
    ap.add_argument("--conn-rate", type=float, default=150.0, help="s3limit: MB/s per connection (0: none)")
    ap.add_argument(
        "--latency", type=float, default=0.020, help="s3limit: seconds to a response's first byte"
    )
    args = ap.parse_args()

    from botocore.config import Config

    report = Report()
    with temp_dir(None) as tmp:
        if args.server == "moto":
            port = free_port()
            moto: subprocess.Popen[bytes] | None = start_moto(port)
            limit = None
            endpoint = f"http://127.0.0.1:{port}"
        else:
            (tmp / "root" / BUCKET).mkdir(parents=True)
            moto = None
            # In its own process, so its send loop does not share the GIL with the client being measured.
            limit = subprocess.Popen(
                [sys.executable, str(HERE / "_s3limit.py"), str(tmp / "root"), "--conn-rate", str(args.conn_rate),
                 "--latency", str(args.latency)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            )  # fmt: skip
            assert limit.stdout is not None
            endpoint = limit.stdout.readline().decode().strip()
            if not endpoint:
                raise SystemExit("benchmarks/_s3limit.py did not start")
        try:
            best, size, machine = run_rounds(args, tmp, endpoint, moto is not None, report, Config)
        finally:
            if moto is not None:
                moto.terminate()
                moto.wait()
            if limit is not None:
                limit.terminate()
                limit.wait()
    write_report(args, best, size, machine, report)
    return 0


def run_rounds(
    args: argparse.Namespace, tmp: Path, endpoint: str, on_moto: bool, report: Report, Config: Any
) -> tuple[dict[str, float], int, Any]:
    import boto3
    import obstore
    from obstore.store import S3Store

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ALLOW_HTTP="true",
    )
    if True:
        if True:
            path = tmp / "shard.smst"
            make_blob(path, args.mib)
            size = path.stat().st_size
            checksum = _core.peek_checksum(str(path)) or ""
            client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
            if on_moto:
                client.create_bucket(Bucket=BUCKET)
                client.upload_file(str(path), BUCKET, "shard.smst")
            else:
                os.link(path, tmp / "root" / BUCKET / "shard.smst")
            url = f"s3://{BUCKET}/shard.smst"
            store = S3Store(BUCKET, client_options={"allow_http": True})
            buf = bytearray(size)

            def plain_obstore() -> int:
                return len(obstore.get(store, "shard.smst").bytes())

            def ours() -> int:
                fetch(url, buf, size=size, checksum=checksum)
                return size

            def ours_one_range() -> int:
                fetch(url, buf, size=size, checksum=checksum, chunk_size=size, concurrency=1)
                return size

            def raw_ranges() -> int:
                # The request pattern of fetch's default, with nothing of smstore: no copy, no hash.
                starts = range(0, size, DEFAULT_CHUNK)
                with ThreadPoolExecutor(DEFAULT_CONCURRENCY) as pool:
                    parts = pool.map(
                        lambda a: obstore.get_range(
                            store, "shard.smst", start=a, end=min(size, a + DEFAULT_CHUNK)
                        ),
                        starts,
                    )
                    return sum(len(p) for p in parts)

            def cached() -> int:
                cache = NodeCache(tmp / f"cache-{time.monotonic_ns()}", 2 * size)
                cache.get(url, checksum=checksum, size=size)
                return size

            def plain_boto3() -> int:
                return len(client.get_object(Bucket=BUCKET, Key="shard.smst")["Body"].read())

            variants: dict[str, Callable[[], int]] = {
                "obstore": plain_obstore,
                "fetch": ours,
                "fetch1": ours_one_range,
                "ranges": raw_ranges,
                "cache": cached,
                "boto3": plain_boto3,
            }
            try:
                import s3fs

                fs = s3fs.S3FileSystem(
                    endpoint_url=endpoint, config_kwargs={"s3": {"addressing_style": "path"}}
                )
                variants["s3fs"] = lambda: len(fs.cat_file(f"{BUCKET}/shard.smst"))
            except ImportError:
                report.notes.append("s3fs is not installed: no s3fs row")
            best = dict.fromkeys(variants, 0.0)
            for r in range(args.rounds):
                for name, run in variants.items():
                    best[name] = max(best[name], rate(run))
                    log(f"round {r + 1} {name}: {best[name] / 2**20:.0f} MiB/s best so far")
            assert bytes(buf) == path.read_bytes()
            machine = machine_info(tmp)
    return best, size, machine


def write_report(
    args: argparse.Namespace, best: dict[str, float], size: int, machine: Any, report: Report
) -> None:
    base = best["obstore"]
    report.add("obstore get (one GET, the baseline)", mibs(base), baseline="itself", ratio="1.00x")
    chunks = f"{DEFAULT_CONCURRENCY} x {DEFAULT_CHUNK >> 20} MiB ranged GETs"
    report.compare(
        f"smstore.remote.fetch, defaults ({chunks}, XXH64 verified)",
        mibs(best["fetch"]),
        mibs(base),
        best["fetch"] / base,
        ">= 0.9x",
        best["fetch"] >= 0.9 * base,
    )
    report.add(
        f"obstore get_range, the same {chunks} on a thread pool (no copy, no hash)",
        mibs(best["ranges"]),
        baseline="obstore",
        ratio=f"{best['ranges'] / base:.2f}x",
    )
    report.compare(
        "smstore.remote.fetch vs the same ranged GETs without smstore (its own cost: copy, hash, bookkeeping)",
        mibs(best["fetch"]),
        mibs(best["ranges"]),
        best["fetch"] / best["ranges"],
        ">= 0.9x",
        best["fetch"] >= 0.9 * best["ranges"],
    )
    report.compare(
        "smstore.remote.fetch, one range (the baseline's request pattern; XXH64 verified)",
        mibs(best["fetch1"]),
        mibs(base),
        best["fetch1"] / base,
        ">= 0.9x",
        best["fetch1"] >= 0.9 * base,
    )
    report.add(
        "NodeCache.get (fetch into a new file, fsync, rename)",
        mibs(best["cache"]),
        baseline="obstore",
        ratio=f"{best['cache'] / base:.2f}x",
    )
    for name, label in (("boto3", "boto3 get_object().read()"), ("s3fs", "s3fs cat_file")):
        if name in best:
            report.add(label, mibs(best[name]), baseline="obstore", ratio=f"{best[name] / base:.2f}x")
    report.notes.append(
        "Each figure is the best of the rounds; the rounds interleave the variants, so load hits all alike."
    )
    if args.server == "moto":
        report.notes.append(
            "moto's server is pure Python and runs on the same cores as the client: it, not the network, "
            "bounds every figure here. It also reads the whole object for every ranged GET (a 1 MiB range of "
            "a 128 MiB object takes as long as a 64 MiB one), so on moto many ranges cost many whole reads: "
            "the row of the same ranged GETs without smstore shows that cost, the rows after it smstore's own."
        )
        server = "a local moto S3 server (its own process)"
    else:
        rate_ = f"{args.conn_rate:.0f} MB/s per connection" if args.conn_rate else "no bandwidth limit"
        report.notes.append(
            f"The server is benchmarks/_s3limit.py in its own process: it reads only the range asked for, "
            f"sends at most {rate_} (a token bucket per response; AWS quotes ~100-200 MB/s per "
            f"connection to S3) and waits {args.latency * 1000:.0f} ms before each response's first byte. "
            "It runs on the same 2 cores as the client, so its Python send loop bounds the parallel rows."
        )
        server = f"benchmarks/_s3limit.py ({rate_}, {args.latency * 1000:.0f} ms to first byte)"
    report.notes += [
        (
            "Against real S3, 8-16 MiB ranged GETs in parallel are what AWS recommends to reach the NIC's "
            "rate, so fetch's default is 8 x 16 MiB; one GET is bounded by one connection's rate."
        ),
    ]
    cmd = command_line("python benchmarks/bench_remote.py")
    write_results(
        args.out,
        "Fetching a shard from object storage",
        [f"`{cmd}`: a {size / 2**20:.0f} MiB blob from {server}, {args.rounds} rounds."],
        machine,
        report,
    )


if __name__ == "__main__":
    raise SystemExit(main())
