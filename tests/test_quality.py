"""The code standards as tests: formatting, lint, types, stubs, and warning-free C++."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pybind11
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The core, the bindings, and the C++ fuzz targets (fuzz/*.cpp, which include only the core).
CPP = (
    sorted((ROOT / "csrc").rglob("*.cpp"))
    + sorted((ROOT / "csrc").rglob("*.hpp"))
    + sorted((ROOT / "fuzz").glob("*.cpp"))
)


def run(*cmd: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False)


def tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed: pip install --group dev (see the README's test command)")
    return path


def test_ruff_lint_and_format() -> None:
    paths = ["smstore", "tests", "benchmarks", "examples", "fuzz", ".ci"]
    lint = run(tool("ruff"), "check", *paths)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run(tool("ruff"), "format", "--check", *paths)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_strict() -> None:
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_stub_matches_compiled_module(tmp_path: Path) -> None:
    # Run outside the source tree so that the installed package (with _core) is checked.
    result = run(
        sys.executable,
        "-m",
        "mypy.stubtest",
        "smstore._core",
        "--mypy-config-file",
        ROOT / "pyproject.toml",
        "--allowlist",
        ROOT / "tests" / "stubtest-allowlist.txt",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_clang_format_clean() -> None:
    result = run(tool("clang-format"), "--dry-run", "-Werror", *CPP)
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_never_includes_pybind11() -> None:
    for path in (ROOT / "csrc").glob("*.[ch]pp"):
        assert "pybind11" not in path.read_text(), f"{path.name}: the core must not include pybind11"


@pytest.mark.parametrize("source", [p for p in CPP if p.suffix == ".cpp"], ids=lambda p: p.name)
def test_cpp_warning_free(source: Path) -> None:
    compiler = shutil.which("c++") or pytest.fail("no C++ compiler")
    result = run(
        compiler,
        "-std=c++17",
        "-fsyntax-only",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-fvisibility=hidden",  # as CMakeLists.txt builds it
        f"-I{ROOT / 'csrc'}",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        '-DSMSTORE_VERSION="test"',
        source,
    )
    assert result.returncode == 0, result.stderr


# An absolute path of the machine a benchmark ran on: /tmp/..., /work/..., /home/..., and so on.
MACHINE_PATH = re.compile(
    r"(?:^|[\s`'\"(=:])(/(?:tmp|work|home|root|mnt|var|opt|srv|scratch|Users)/[^\s`'\")]*)"
)


def machine_paths(text: str) -> list[str]:
    return MACHINE_PATH.findall(text)


def test_machine_paths_are_found() -> None:
    assert machine_paths("- temp dir: /tmp/smstore-bench-x1 (ext4)") == ["/tmp/smstore-bench-x1"]
    assert machine_paths("`python b.py --out /work/main/r.md`") == ["/work/main/r.md"]
    assert machine_paths("- temp files: ext4; `--out $TMPDIR/r.md`; see benchmarks/results/r.md") == []


def test_a_results_header_names_no_path_of_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line a results file quotes names its paths (``--out``, ``--tmpdir``) relative to
    the repository or by their last part, wherever they are: the header quoted them as given."""
    if str(ROOT) not in sys.path:
        monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.bench_core import Report, command_line, write_results

    home = tmp_path / "home" / "someone"
    monkeypatch.setenv("HOME", str(home))
    argv = [
        "--out",
        "/home/someone/results/windowed.md",
        "--tmpdir=/scratch/fast",
        str(ROOT / "benchmarks" / "results" / "windowed.md"),
        str(home / "w.md"),
        "--quick",
    ]
    cmd = command_line("python benchmarks/bench_windowed.py", argv)
    out = tmp_path / "out.md"
    write_results(out, "A run", [f"`{cmd}` on a day."], ["- temp files: ext4"], Report())
    text = out.read_text()
    assert machine_paths(text) == []
    assert (
        "`python benchmarks/bench_windowed.py --out .../windowed.md --tmpdir=.../fast "
        "benchmarks/results/windowed.md ~/w.md --quick`"
    ) in text


def test_results_files_name_no_path_of_the_machine() -> None:
    """A results file (the tables and a run's raw JSON) says what ran and on what, never where: no
    temp dir, checkout or home path."""
    found = {
        str(f.relative_to(ROOT)): machine_paths(f.read_text())
        for pattern in ("*.md", "*.json")
        for f in sorted((ROOT / "benchmarks" / "results").glob(pattern))
    }
    assert {f: p for f, p in found.items() if p} == {}
