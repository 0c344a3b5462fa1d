"""Check a built smstore wheel's contents (.ci/wheel): python wheel_contents.py WHEEL (needs pyelftools).

What goes in: the package with py.typed, _core.pyi and one compiled module; the metadata with the
dependencies and every extra of pyproject.toml, and the `smstore` command. What stays out: tests,
benchmarks, examples, fuzz targets, C++ sources. The module has no absolute rpath and no symbol table.
"""

from __future__ import annotations

import email.parser
import io
import re
import sys
import zipfile
from pathlib import Path

import tomllib
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

ROOT = Path(__file__).resolve().parent.parent
# What the module may link against: libraries every manylinux system has (auditwheel's policy).
SYSTEM_LIBS = re.compile(
    r"(libstdc\+\+|libgcc_s|libc|libm|libpthread|libdl|librt|ld-linux-[\w-]+)\.so(\.\d+)*"
)


def fail(message: str) -> None:
    raise SystemExit(f"{sys.argv[1]}: {message}")


def check_names(names: list[str]) -> str:
    """The compiled module's name, once every file is where it belongs."""
    outside = [n for n in names if not re.match(r"smstore/|smstore-[^/]+\.dist-info/|smstore\.libs/", n)]
    if outside:
        fail(f"files outside the package: {outside}")
    for required in (
        "smstore/__init__.py",
        "smstore/py.typed",
        "smstore/_core.pyi",
        "smstore/daemon/server.py",
    ):
        if required not in names:
            fail(f"{required} is missing")
    stray = [n for n in names if re.search(r"/(tests|benchmarks|examples|fuzz|csrc)/|\.(cpp|hpp)$", n)]
    if stray:
        fail(f"source-tree files in the wheel: {stray}")
    modules = [n for n in names if re.fullmatch(r"smstore/_core\.cpython-\d+-[\w-]+\.so", n)]
    if len(modules) != 1:
        fail(f"expected one compiled module smstore/_core.cpython-*.so, found {modules}")
    return modules[0]


def check_metadata(wheel: zipfile.ZipFile, names: list[str]) -> None:
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    msg = email.parser.Parser().parsestr(wheel.read(meta).decode())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(msg.get_all("Provides-Extra") or [])
    if extras != set(project["optional-dependencies"]):
        fail(f"extras {sorted(extras)}, pyproject.toml has {sorted(project['optional-dependencies'])}")
    plain = {r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r}
    if plain != set(project["dependencies"]):
        fail(f"dependencies {sorted(plain)}, pyproject.toml has {project['dependencies']}")
    if msg["Requires-Python"] != project["requires-python"] or msg["Version"] != project["version"]:
        fail(f"Requires-Python {msg['Requires-Python']}, Version {msg['Version']}: not pyproject.toml's")
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    if "smstore = smstore.cli:main" not in wheel.read(entry).decode():
        fail("no `smstore` console script")


def check_module(data: bytes, names: list[str]) -> None:
    elf = ELFFile(io.BytesIO(data))
    sections = {s.name for s in elf.iter_sections()}
    if ".symtab" in sections or any(s.startswith(".debug") for s in sections):
        fail(f"the compiled module is not stripped: {sorted(sections)}")
    for section in elf.iter_sections():
        if not isinstance(section, DynamicSection):
            continue
        for tag in section.iter_tags():
            if tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                paths = (getattr(tag, "rpath", "") or getattr(tag, "runpath", "")).split(":")
                absolute = [p for p in paths if p and not p.startswith("$ORIGIN")]
                if absolute:
                    fail(f"the compiled module has an absolute {tag.entry.d_tag}: {absolute}")
            elif tag.entry.d_tag == "DT_NEEDED" and not (
                SYSTEM_LIBS.fullmatch(tag.needed) or f"smstore.libs/{tag.needed}" in names
            ):
                fail(f"the compiled module needs {tag.needed}, neither a system library nor grafted")


def main() -> None:
    path = Path(sys.argv[1])
    if not re.search(r"-manylinux_\d+_\d+_[\w.]+\.whl$", path.name):
        fail("not a repaired (manylinux) wheel")
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        module = check_names(names)
        check_metadata(wheel, names)
        check_module(wheel.read(module), names)
    print(f"wheel contents: {path.name}, {path.stat().st_size / 1e6:.2f} MB, {len(names)} files: as expected")


if __name__ == "__main__":
    main()
