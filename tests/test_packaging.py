"""The wheel's configuration, read statically: what goes into it, how it is built, which ones CI builds.

Building a wheel here would take minutes of compiling; .ci/wheel builds the real one, checks its
contents (.ci/wheel_contents.py) and installs it without a compiler.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SKBUILD = PYPROJECT["tool"]["scikit-build"]
CIBW = PYPROJECT["tool"]["cibuildwheel"]


def test_the_wheel_holds_the_package_only() -> None:
    # scikit-build-core packs these folders and what CMake installs: no tests, benchmarks or sources.
    assert SKBUILD["wheel"]["packages"] == ["smstore"]
    assert "exclude" not in SKBUILD["wheel"]  # (the typing files must not be excluded either)
    assert re.search(
        r"^install\(TARGETS _core DESTINATION smstore\)$", (ROOT / "CMakeLists.txt").read_text(), re.MULTILINE
    )


@pytest.mark.parametrize("name", ["py.typed", "_core.pyi", "__init__.py"])
def test_typing_files_are_not_ignored_so_they_are_packed(name: str) -> None:
    """scikit-build-core leaves out of the wheel what .gitignore matches (it ignores `*.so` there)."""
    path = ROOT / "smstore" / name
    assert path.is_file()
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, check=False
    )
    assert ignored.returncode == 1, f"{path} matches .gitignore: the wheel would lack it"


def test_the_module_is_stripped_and_has_no_install_rpath() -> None:
    assert SKBUILD["install"]["strip"] is True
    cmake = (ROOT / "CMakeLists.txt").read_text()
    # An rpath at install would point into the build machine; auditwheel sets one only for what it grafts.
    assert not re.search(r"INSTALL_RPATH|BUILD_WITH_INSTALL_RPATH|RPATH", cmake)


def supported_pythons() -> list[str]:
    """The CPython minor versions from requires-python's lower bound to 3.13."""
    low = re.fullmatch(r">=3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert low, "requires-python is not '>=3.N'"
    return [f"cp3{minor}-*" for minor in range(int(low.group(1)), 14)]


def test_cibuildwheel_builds_every_supported_cpython_on_glibc_x86_64_and_aarch64() -> None:
    assert CIBW["build"] == supported_pythons() == ["cp310-*", "cp311-*", "cp312-*", "cp313-*"]
    assert CIBW["linux"]["archs"] == ["x86_64", "aarch64"]
    assert CIBW["manylinux-x86_64-image"] == CIBW["manylinux-aarch64-image"] == "manylinux_2_28"
    assert set(CIBW["skip"]) == {"*-musllinux_*", "*-manylinux_i686"}
    assert "enable" not in CIBW  # PyPy and free-threaded CPython stay off


def test_cibuildwheel_runs_the_smoke_test_of_ci_wheel() -> None:
    command = CIBW["test-command"]
    script = re.fullmatch(r"python \{project\}/(\S+)", command)
    assert script, command
    assert (ROOT / script.group(1)).is_file()
    assert script.group(1) in (ROOT / ".ci" / "wheel").read_text()


def test_ci_runs_the_wheel_stage_after_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    (test_command,) = re.findall(r"^pip install -U pip && pip install .*&& pytest$", readme, re.MULTILINE)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
    wheel = [i for i, line in enumerate(ci) if line.startswith("bash .ci/wheel")]
    assert wheel, ".ci/run has no wheel stage"
    assert wheel[0] > ci.index(test_command)
