"""Runs the fuzz targets for a bounded time each and reports executions, coverage and crashes (docs/fuzzing.md)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"
VENV = ROOT / ".venv-fuzz"
PYTHON = VENV / "bin" / "python"
TARGETS = ["blob", "jsonl", "npy_lines", "daemon", "arrow", "tar", "json_list", "shard_index"]
# C++ targets: fuzz/fuzz_<target>.cpp linked by clang with libFuzzer and the core sources it tests
# (no Python, no pybind11), built into build/fuzz/. The others are atheris scripts run by .venv-fuzz.
NATIVE = {"shard_index": ["csrc/shard_index.cpp"]}
NATIVE_FLAGS = ["-std=c++17", "-O1", "-g", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]
# Longer inputs than libFuzzer's default 4096 where seeds are longer: blobs with a full 4096-byte
# header, Parquet files with their footer, tar files of a few 512-byte blocks. libFuzzer cuts a
# seed longer than this, so make_corpus.py keeps the seeds under it.
MAX_LEN = {"blob": 8192, "arrow": 8192, "tar": 8192}
# atheris 3.0.0's bundled ASan+libFuzzer runtime works with clang 14's instrumentation once the
# vptr and function checks are off (CMakeLists.txt, SMSTORE_FUZZ); another atheris may not.
ATHERIS = "atheris==3.0.0"
# What the targets import besides smstore: the converters' oracles are the real libraries
# (pyproject's convert and test extras allow these; the dev venv has the same versions).
DEPENDENCIES = [ATHERIS, "xxhash", "pyarrow==26.0.1", "webdataset==1.0.2"]
DEPENDENCY_MODULES = "atheris, xxhash, pyarrow.parquet, webdataset"
ARTIFACTS = ("crash-", "leak-", "timeout-", "oom-")


def prepare_venv(rebuild: bool) -> None:
    """.venv-fuzz with the targets' dependencies and the instrumented build, each step only when missing.

    A .venv-fuzz made before a target needed a new dependency gets it installed without a rebuild.
    """
    if not PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    pip = [PYTHON, "-m", "pip", "install", "--quiet", "--progress-bar", "off"]
    if not imports(DEPENDENCY_MODULES):
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, *DEPENDENCIES], check=True)
    if rebuild or not imports("smstore._core"):
        build_extension(pip)


def build_extension(pip: list[str | Path]) -> None:
    """The instrumented build: clang, SMSTORE_FUZZ=ON, symbols kept for stack traces."""
    if not (shutil.which("clang") and shutil.which("clang++")):
        sys.exit("fuzz/run.py needs clang and clang++ (Debian: apt-get install clang libclang-rt-14-dev)")
    build = ["-Ccmake.define.SMSTORE_FUZZ=ON", "-Cbuild-dir=build/fuzz", "-Cinstall.strip=false"]
    env = {**os.environ, "CC": "clang", "CXX": "clang++"}
    # Uninstalled first: pip would keep an installed smstore of the same version.
    subprocess.run([PYTHON, "-m", "pip", "uninstall", "--quiet", "--yes", "smstore"], check=True)
    subprocess.run([*pip, ".", *build], check=True, cwd=ROOT, env=env)


def build_native(target: str, rebuild: bool) -> Path:
    """The libFuzzer binary of a C++ target, built when missing, older than its sources, or asked to."""
    binary = ROOT / "build" / "fuzz" / f"fuzz_{target}"
    sources = [FUZZ / f"fuzz_{target}.cpp", *(ROOT / s for s in NATIVE[target])]
    inputs = [*sources, *(ROOT / "csrc").glob("*.hpp")]
    if not rebuild and binary.exists() and all(p.stat().st_mtime <= binary.stat().st_mtime for p in inputs):
        return binary
    if not shutil.which("clang++"):
        sys.exit("fuzz/run.py needs clang++ (Debian: apt-get install clang libclang-rt-14-dev)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["clang++", *NATIVE_FLAGS, "-I", ROOT / "csrc", *sources, "-o", binary], check=True)
    return binary


def target_command(target: str) -> list[str | Path]:
    """How a target runs: its libFuzzer binary, or its atheris script under .venv-fuzz's Python."""
    if target in NATIVE:
        return [ROOT / "build" / "fuzz" / f"fuzz_{target}"]
    return [PYTHON, FUZZ / f"fuzz_{target}.py"]


def imports(modules: str) -> bool:
    """Whether .venv-fuzz's Python imports these modules (with the fuzzing runtime preloaded)."""
    probe = f"import {modules}"
    return (
        PYTHON.exists()
        and subprocess.run(
            [PYTHON, "-c", probe], check=False, capture_output=True, cwd="/", env=fuzz_env(None)
        ).returncode
        == 0
    )


def fuzz_env(scratch: Path | None, native: bool = False) -> dict[str, str]:
    """Preload atheris's ASan+libFuzzer runtime, which the instrumented extension links against
    (a C++ target carries its own runtime: nothing is preloaded for it)."""
    runtime = next((VENV / "lib").glob("python3*/site-packages/asan_with_fuzzer.so"), None)
    env = dict(os.environ)
    if runtime is not None and not native:
        env["LD_PRELOAD"] = str(runtime)
    # Python itself leaks by design at exit; UBSan reports are fatal (built -fno-sanitize-recover).
    env["ASAN_OPTIONS"] = "detect_leaks=0:allocator_may_return_null=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1"
    symbolizer = shutil.which("llvm-symbolizer") or shutil.which("llvm-symbolizer-14")
    if symbolizer:
        env["ASAN_SYMBOLIZER_PATH"] = symbolizer
    if scratch is not None:
        env["SMSTORE_FUZZ_TMPDIR"] = str(scratch)
    return env


@dataclass
class Result:
    target: str
    returncode: int
    executions: int
    corpus_files: int
    features_start: int | None
    features_end: int | None
    artifacts: list[Path]
    log: Path
    seconds: float


def last_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def run_target(target: str, seconds: int, corpus: Path, work: Path) -> Result:
    artifacts, scratch = work / "artifacts" / target, work / "scratch" / target
    artifacts.mkdir(parents=True)
    scratch.mkdir(parents=True)
    log = work / f"{target}.log"
    cmd = [
        *target_command(target),
        corpus,
        f"-max_total_time={seconds}",
        "-rss_limit_mb=2048",
        "-timeout=10",
        f"-max_len={MAX_LEN.get(target, 4096)}",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/",
    ]
    start = time.monotonic()
    with log.open("wb") as out:
        try:
            # libFuzzer stops itself after max_total_time; the margin covers loading and the last input.
            rc = subprocess.run(
                cmd,
                check=False,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=scratch,
                env=fuzz_env(scratch, target in NATIVE),
                timeout=seconds + 120,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    text = log.read_text(errors="replace")
    return Result(
        target,
        rc,
        last_int(r"stat::number_of_executed_units: (\d+)", text) or last_int(r"^#(\d+)", text) or 0,
        sum(1 for _ in corpus.iterdir()),
        last_int(r"INITED .*?ft: (\d+)", text),
        last_int(r"(?:DONE|NEW|REDUCE|pulse) .*?ft: (\d+)", text),
        sorted(p for p in artifacts.iterdir() if p.name.startswith(ARTIFACTS)),
        log,
        time.monotonic() - start,
    )


def smstore_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if "smstore" in p.name}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="targets run at the same time")
    parser.add_argument("--corpus-dir", type=Path, help="keep the grown corpora here (default: a temp copy)")
    parser.add_argument("--reproduce", type=Path, help="run one target on this input file, once")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the instrumented extension")
    args = parser.parse_args()
    targets = args.targets or TARGETS
    if not set(targets) <= set(TARGETS):
        parser.error(f"unknown target among {targets}: the targets are {TARGETS}")
    if not 1 <= args.seconds <= 7 * 24 * 3600 or not 1 <= args.jobs <= 64:
        parser.error("--seconds must be in [1, 604800] and --jobs in [1, 64]")
    if set(targets) - NATIVE.keys():
        prepare_venv(args.rebuild)
    for t in set(targets) & NATIVE.keys():
        build_native(t, args.rebuild)
    if args.reproduce is not None:
        if len(targets) != 1:
            parser.error("--reproduce needs exactly one target")
        cmd = [*target_command(targets[0]), args.reproduce.resolve()]
        with tempfile.TemporaryDirectory(prefix="smstore-fuzz-") as tmp:
            env = fuzz_env(Path(tmp), targets[0] in NATIVE)
            return subprocess.run(cmd, check=False, cwd=tmp, env=env, timeout=600).returncode

    shm_before = smstore_shm()
    work = Path(tempfile.mkdtemp(prefix="smstore-fuzz-"))
    try:
        corpora = {}
        for t in targets:
            corpora[t] = (args.corpus_dir or work / "corpus") / t
            corpora[t].mkdir(parents=True, exist_ok=True)
            for seed in (FUZZ / "corpus" / t).iterdir():
                if not (corpora[t] / seed.name).exists():
                    shutil.copy(seed, corpora[t] / seed.name)
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda t: run_target(t, args.seconds, corpora[t], work), targets))
        return report(results, smstore_shm() - shm_before)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(results: list[Result], shm_left: set[str]) -> int:
    failed = False
    print(
        f"{'target':<10} {'seconds':>7} {'executions':>11} {'exec/s':>7} {'corpus':>7} {'new features':>13}  result"
    )
    for r in results:
        new = r.features_end - r.features_start if None not in (r.features_start, r.features_end) else "?"
        bad = bool(r.artifacts) or r.returncode != 0
        failed |= bad
        verdict = f"FAILED (exit {r.returncode}, {len(r.artifacts)} crash file(s))" if bad else "ok"
        rate = r.executions / max(r.seconds, 1e-9)
        print(
            f"{r.target:<10} {r.seconds:7.0f} {r.executions:11d} {rate:7.0f} {r.corpus_files:7d} {new!s:>13}  {verdict}"
        )
    if failed:
        keep = Path(tempfile.mkdtemp(prefix="smstore-fuzz-crashes-"))
        for r in results:
            if r.artifacts or r.returncode != 0:
                shutil.copy(r.log, keep / r.log.name)
                for a in r.artifacts:
                    shutil.copy(a, keep / f"{r.target}-{a.name}")
                tail = r.log.read_text(errors="replace").splitlines()[-60:]
                print(f"\n==== {r.target}: the end of its log ====", *tail, sep="\n")
        print(f"\nCrash inputs and logs kept in {keep}; reproduce with:")
        print(f"  python fuzz/run.py TARGET --reproduce {keep}/TARGET-crash-...")
    if shm_left:
        failed = True
        print(f"left in /dev/shm: {sorted(shm_left)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
