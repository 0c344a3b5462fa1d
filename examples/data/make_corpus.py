"""Regenerates corpus.txt: English text from the Python standard library's own documentation."""

from __future__ import annotations

import ast
import pydoc_data.topics
import sys
import sysconfig
from pathlib import Path

TARGET_BYTES = 1_500_000


def paragraphs() -> list[str]:
    """pydoc's help topics, then the docstrings of the stdlib's pure-Python modules, in path order."""
    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[len(stdlib.parts) :] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    texts.append(doc)
    return texts


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("corpus.txt")
    lines: list[str] = []
    size = 0
    seen: set[str] = set()
    for text in paragraphs():
        for raw in text.splitlines():
            line = " ".join(raw.split())
            if (
                len(line) < 20
                or line in seen
                or not line.isascii()
                or sum(c.isalpha() for c in line) < len(line) // 2
            ):
                continue
            seen.add(line)
            lines.append(line)
            size += len(line) + 1
            if size >= TARGET_BYTES:
                break
        if size >= TARGET_BYTES:
            break
    out.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"{out}: {len(lines)} lines, {size} bytes (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
