"""`smstore pack/join -o s3://...` against a real S3 server (moto): byte-exact round trips, manifest last, interrupts."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the remote extra (boto3) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from remote_testlib import BUCKET, S3, FaultProxy
from smstore_testlib import child_process, read_records


def write_lines(path: Path, mib: float, seed: int) -> list[bytes]:
    """A text file of about `mib` MiB of random lines; its lines (the records `pack` makes)."""
    rng = random.Random(seed)
    lines = []
    size = 0
    while size < mib * (1 << 20):
        line = bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz \t", k=rng.randrange(0, 4000)))
        lines.append(line)
        size += len(line) + 1
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return lines


def cli(*args: str, tmpdir: Path) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    env = dict(os.environ, TMPDIR=str(tmpdir))  # the s3 fixture set the AWS variables in os.environ
    return child_process(
        [sys.executable, "-m", "smstore", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def run_cli(*args: str, tmpdir: Path) -> str:
    with cli(*args, tmpdir=tmpdir) as p:
        _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    return err.decode()


def download(s3: S3, prefix: str, into: Path) -> list[str]:
    keys = sorted(k for k in s3.object_keys() if k.startswith(prefix))
    into.mkdir(parents=True, exist_ok=True)
    for key in keys:
        (into / key[len(prefix) :]).write_bytes(s3.get(key))
    return [k[len(prefix) :] for k in keys]


@pytest.fixture
def tmpdir_for_cli(tmp_path: Path) -> Path:
    d = tmp_path / "tmpdir"
    d.mkdir()
    return d


def test_pack_to_a_bucket_round_trips_byte_exact_with_the_manifest_last(
    s3: S3, proxy: FaultProxy, tmp_path: Path, tmpdir_for_cli: Path
) -> None:
    lines = write_lines(tmp_path / "in.txt", 3, seed=1)
    # A single blob.
    run_cli("pack", str(tmp_path / "in.txt"), "-o", s3.url("cli/one.smst"), tmpdir=tmpdir_for_cli)
    run_cli("pack", str(tmp_path / "in.txt"), "-o", str(tmp_path / "local.smst"), tmpdir=tmpdir_for_cli)
    (tmp_path / "one.smst").write_bytes(s3.get("cli/one.smst"))
    assert read_records(tmp_path / "one.smst", verify=True) == lines
    # A sharded dataset, two jobs: shards, then the manifest, all under the prefix.
    proxy.seen.clear()
    err = run_cli(
        "pack", str(tmp_path / "in.txt"), "-o", s3.url("cli/ds/"), "-j", "2", "--shard-size", "1M",
        tmpdir=tmpdir_for_cli,
    )  # fmt: skip
    assert s3.url("cli/ds/manifest.json") in err
    names = download(s3, "cli/ds/", tmp_path / "ds")
    assert "manifest.json" in names
    assert len(names) > 3
    assert read_records(tmp_path / "ds", verify=True) == lines
    writes = [s.path for s in proxy.seen if s.method in ("PUT", "POST")]
    assert writes[-1].startswith(f"/{BUCKET}/cli/ds/manifest.json")
    assert all("manifest.json" not in w for w in writes[:-1])
    assert s3.multipart_uploads() == []
    assert os.listdir(tmpdir_for_cli) == []  # the packed temp copy is gone


def test_join_to_a_bucket_uploads_the_shards_then_a_manifest_naming_them(
    s3: S3, proxy: FaultProxy, tmp_path: Path, tmpdir_for_cli: Path
) -> None:
    a = write_lines(tmp_path / "a.txt", 1, seed=2)
    b = write_lines(tmp_path / "b.txt", 1, seed=3)
    run_cli(
        "pack",
        str(tmp_path / "a.txt"),
        "-o",
        str(tmp_path / "a/"),
        "--shard-size",
        "300K",
        tmpdir=tmpdir_for_cli,
    )
    run_cli("pack", str(tmp_path / "b.txt"), "-o", str(tmp_path / "b.smst"), tmpdir=tmpdir_for_cli)
    proxy.seen.clear()
    run_cli(
        "join",
        str(tmp_path / "a"),
        str(tmp_path / "b.smst"),
        "-o",
        s3.url("cli/joined/"),
        tmpdir=tmpdir_for_cli,
    )
    download(s3, "cli/joined/", tmp_path / "joined")
    assert read_records(tmp_path / "joined", verify=True) == a + b
    writes = [s.path for s in proxy.seen if s.method in ("PUT", "POST")]
    assert writes[-1].startswith(f"/{BUCKET}/cli/joined/manifest.json")
    assert all("manifest.json" not in w for w in writes[:-1])
    assert os.listdir(tmpdir_for_cli) == []


def test_pack_refuses_a_read_only_scheme_before_packing(tmp_path: Path, tmpdir_for_cli: Path) -> None:
    write_lines(tmp_path / "in.txt", 0.01, seed=4)
    with cli("pack", str(tmp_path / "in.txt"), "-o", "gs://bucket/x.smst", tmpdir=tmpdir_for_cli) as p:
        _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "gs://bucket/x.smst: pack and join upload to s3:// only" in err.decode()
    assert os.listdir(tmpdir_for_cli) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_pack_to_a_bucket_leaves_no_upload_and_no_manifest(
    s3: S3, proxy: FaultProxy, tmp_path: Path, tmpdir_for_cli: Path, sig: signal.Signals, ctrl_c: None
) -> None:
    # One ~40 MiB shard, so its upload is multipart (16 MiB parts); the proxy stalls part 2 and the
    # test signals the command while it waits for that part.
    write_lines(tmp_path / "in.txt", 40, seed=5)
    prefix = f"cli/int-{sig.name}/"
    proxy.inject("stall", matches=lambda method, path, headers: method == "PUT" and "partNumber=2" in path)
    with cli(
        "pack", str(tmp_path / "in.txt"), "-o", s3.url(prefix), "--shard-size", "1G", tmpdir=tmpdir_for_cli
    ) as p:
        if not proxy.stalled.wait(240):
            pytest.fail(
                f"the upload never reached part 2: {p.stderr.read().decode() if p.poll() is not None else ''}"  # type: ignore[union-attr]
            )
        assert len(s3.multipart_uploads()) == 1  # the upload is under way
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    assert not [k for k in s3.object_keys() if k.startswith(prefix)]  # no shard, no manifest
    if sig == signal.SIGKILL:
        # Nothing can abort after kill -9: the upload stays until a lifecycle rule removes it (docs).
        left = s3.multipart_uploads()
        assert len(left) == 1
        assert left[0]["Key"].startswith(prefix)
        for u in left:
            s3.client.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])
        return
    assert p.returncode == 130, err.decode()
    assert "interrupted" in err.decode()
    assert s3.multipart_uploads() == []
    assert os.listdir(tmpdir_for_cli) == []  # the temp copy was removed on the way out
