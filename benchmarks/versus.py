"""Trees of smstore against each other on the same benchmarks, in one run: medians and ratios (issue 37).

    python benchmarks/versus.py --variant before=VENV1/bin/python:TREE1 \\
        --variant after=VENV2/bin/python:TREE2 --rounds 3 --out benchmarks/results/versus-37.md

A variant is a name, a Python and a tree: that Python (an environment where the tree is installed,
`pip install -e TREE`) runs the tree's own benchmark scripts, so the trees may lay out their modules
differently; only the Markdown tables the scripts write (`--out`) are compared. Rounds interleave
the variants (before, after; then after, before; ...), one benchmark after another, at the quick
sizes of `BENCHMARKS`; the first variant is the baseline.

The figures of a table are the numbers in its rows' value and baseline cells, outside parentheses,
each keyed by its row (the metric, its numbers masked), the words before it in its clause and its
unit. Each one's median per variant (and the range of its runs) is given, with the ratio to the
baseline's median and the way that is better (by its unit: times and memory lower, rates higher).
A figure the same in every run of every variant (a size, a count, the statistic of a seeded order)
is left out. The numbers of the metric and those in parentheses are the set-up (sizes, counts,
ranges): one the same in every run of a variant but not in every variant is listed apart, since
then the trees measured different things.

`--raw DIR` keeps every run's table and output; `--from DIR` writes the report again from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from bench_core import command_line, log, machine_info, portable, temp_dir

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    """A script of benchmarks/ at a quick size; `split`: rows whose metric starts with a prefix go
    to a table of their own, (prefix, title)."""

    name: str
    script: str
    args: tuple[str, ...]
    split: tuple[tuple[str, str], ...] = ()


BENCHMARKS = (
    # Without the second epoch (at the least lag: an info row), a quick run is about a minute.
    Benchmark("windowed", "bench_windowed.py", ("--quick", "--no-least-lag"), (("blocks: ", "blocks"),)),
    Benchmark("mixture", "bench_mixture.py", ("--quick",)),
    Benchmark("loader", "bench_loader.py", ("--quick",)),
    Benchmark("remote", "bench_remote.py", ("--mib", "64", "--rounds", "2")),
    Benchmark("remote_windowed", "bench_remote_windowed.py", ("--quick",)),
    Benchmark("packing", "bench_packing.py", ("--quick",)),
)

# ---- reading a results page -----------------------------------------------------------------------

NUMBER = re.compile(
    r"(?<![\w.^])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?(?:e[+-]?\d+)?)"  # 3,000 / 1.5 / 2.40e-01
    r"(?: ?((?:[kMG] (?=[a-z]))?[A-Za-zµ%]+(?:/[A-Za-z]+)?))?"  # its unit: ms, MiB/s, M records/s, %
)
LOWER_IS_BETTER = {"ns", "us", "µs", "ms", "s", "min", "h", "B", "bytes", "KiB", "MiB", "GiB", "%"}
LOWER_IS_BETTER |= {"mismatches", "missed"}


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    label: str  # the words before it in its clause, '…' for the number, its unit
    setup: bool  # in the metric or in parentheses: what was measured, not a result

    def better(self) -> str:
        if self.unit.endswith("/s") or self.unit == "shards/batch" or self.label.startswith("carrying"):
            return "higher"
        lower = self.unit in LOWER_IS_BETTER or self.label.startswith(
            ("neighbours together", "from the files")
        )
        return "lower" if lower else ""


def mask(text: str) -> str:
    """`text` with its numbers as '#' (their units kept)."""
    return NUMBER.sub(lambda m: "#" + m.group(0)[len(m.group(1)) :], text)


def figures(text: str, setup: bool) -> list[Figure]:
    """The numbers of a cell, each with its unit and the clause it ends (from the last , ; ( or ' / ')."""
    out = []
    for m in NUMBER.finditer(text):
        before = text[: m.start()]
        start = max(before.rfind(c) for c in (",", ";", "(", " / ")) + 1
        clause = mask(before[start:]).strip(" :")
        label = " ".join(x for x in (clause, "…", m.group(2)) if x)
        nested = before.count("(") > before.count(")")
        out.append(Figure(float(m.group(1).replace(",", "")), m.group(2) or "", label, setup or nested))
    return out


@dataclass(frozen=True)
class Row:
    metric: str
    value: str
    baseline: str
    met: str

    def key(self) -> str:
        return mask(self.metric)

    def figures(self) -> dict[str, Figure]:
        """By cell and label; a label repeated in a cell is numbered (' #2')."""
        out: dict[str, Figure] = {}
        for cell, text in (("metric", self.metric), ("value", self.value), ("baseline", self.baseline)):
            for f in figures(text, setup=cell == "metric"):
                if cell == "baseline":
                    f = replace(f, label=f"baseline: {f.label}")
                key, n = f"{cell}: {f.label}", 1
                while key in out:
                    n += 1
                    key = f"{cell}: {f.label} #{n}"
                out[key] = f
        return out


def read_rows(text: str) -> list[Row]:
    """The rows of a results page's `| metric | value | baseline | ratio | goal | met? |` table."""
    lines = text.splitlines()
    if "| metric | value | baseline | ratio | goal | met? |" not in lines:
        return []
    start = lines.index("| metric | value | baseline | ratio | goal | met? |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        metric, value, baseline, _ratio, _goal, met = (c.strip() for c in line.strip("|").split("|"))
        rows.append(Row(metric, value, baseline, met.strip("*")))
    return rows


# ---- comparing the runs ---------------------------------------------------------------------------


def number(x: float) -> str:
    if x != 0 and (abs(x) < 0.01 or abs(x) >= 1e7):
        return f"{x:.2e}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def median_and_range(xs: list[float]) -> str:
    med = number(statistics.median(xs))
    return med if min(xs) == max(xs) else f"{med} ({number(min(xs))}-{number(max(xs))})"


def verdict(way: str, base: list[float], xs: list[float]) -> str:
    """Better or worse only where every run of one is on that side of every run of the other."""
    if not way:
        return "-"
    if (max(xs) < min(base)) if way == "lower" else (min(xs) > max(base)):
        return "**better**"
    if (min(xs) > max(base)) if way == "lower" else (max(xs) < min(base)):
        return "**worse**"
    return "ranges overlap"


@dataclass
class Comparison:
    """One table: each row (by its key) in each variant's runs."""

    names: list[str]
    rows: dict[str, dict[str, list[Row]]] = field(default_factory=dict)

    def add(self, variant: str, rows: list[Row]) -> None:
        seen: dict[str, int] = {}
        for row in rows:
            seen[row.key()] = seen.get(row.key(), 0) + 1
            self.rows.setdefault(f"{row.key()} #{seen[row.key()]}", {}).setdefault(variant, []).append(row)

    @staticmethod
    def metric(runs: list[Row]) -> str:
        """The metric, each of its numbers that is not the same in every run shown as '…'."""
        numbers = [[m.group(1) for m in NUMBER.finditer(r.metric)] for r in runs]
        moved = {i for i, xs in enumerate(zip(*numbers, strict=True)) if len(set(xs)) > 1}
        parts, end = [], 0
        for i, m in enumerate(NUMBER.finditer(runs[0].metric)):
            parts += [runs[0].metric[end : m.start(1)], "…" if i in moved else m.group(1)]
            end = m.end(1)
        return "".join(parts) + runs[0].metric[end:]

    def lines(self) -> list[str]:
        """The table of the figures that moved, then notes: set-ups that differ, what a variant lacks."""
        base, others = self.names[0], self.names[1:]
        table = [
            "| row | figure | better | " + " | ".join(f"{n}: median (range)" for n in self.names)
            + "".join(f" | {n} / {base} | {n} is" for n in others) + " |",
            "|---|---|---|" + "---|" * (len(self.names) + 2 * len(others)),
        ]  # fmt: skip
        notes: list[str] = []
        alike = repeated = 0
        shown: set[tuple[tuple[float, ...], ...]] = (
            set()
        )  # a figure's runs, to show it once (a row's baseline is often another's value)
        for by_variant in self.rows.values():
            metric = self.metric([r for rs in by_variant.values() for r in rs])
            if any(n not in by_variant for n in self.names):
                notes.append(f"a row only {', '.join(by_variant)} wrote: {metric}")
                continue
            met = {n: sum(r.met == "yes" for r in by_variant[n]) / len(by_variant[n]) for n in self.names}
            if by_variant[base][0].met != "-" and len(set(met.values())) > 1:
                shares = ", ".join(f"{n} {met[n]:.0%} of its runs" for n in self.names)
                notes.append(f"goal met: {metric}: {shares}")
            values: dict[str, dict[str, list[float]]] = {}
            first: dict[str, Figure] = {}
            for n in self.names:
                for row in by_variant[n]:
                    for k, f in row.figures().items():
                        values.setdefault(k, {}).setdefault(n, []).append(f.value)
                        first.setdefault(k, f)
            for k, vals in values.items():
                f = first[k]
                if any(n not in vals for n in self.names):
                    notes.append(f"a figure only {', '.join(vals)} wrote: {metric}: {f.label}")
                elif len({v for xs in vals.values() for v in xs}) == 1:
                    alike += 1
                elif not f.setup and tuple(tuple(vals[n]) for n in self.names) in shown:
                    repeated += 1
                elif not f.setup:
                    shown.add(tuple(tuple(vals[n]) for n in self.names))
                    ref = statistics.median(vals[base])
                    cells = [median_and_range(vals[n]) for n in self.names]
                    for n in others:
                        cells += [f"{statistics.median(vals[n]) / ref:.2f}x" if ref else "-"]
                        cells += [verdict(f.better(), vals[base], vals[n])]
                    table.append(
                        f"| {metric} | {f.label} | {f.better() or '-'} | " + " | ".join(cells) + " |"
                    )
                elif all(len(xs) > 1 and len(set(xs)) == 1 for xs in vals.values()):
                    differ = ", ".join(f"{n} {number(vals[n][0])}" for n in self.names)
                    notes.append(
                        f"**set-up that differs** (the same in every run of a variant): {metric}: {f.label}: {differ}"
                    )
        written = sum(all(n in by_variant for n in self.names) for by_variant in self.rows.values())
        notes[:0] = [
            f"{written} rows written by every variant, {len(self.rows) - written} by some",
            f"{alike} figures the same in every run of every variant (sizes, counts, seeded orders): not shown",
            f"{repeated} figures repeating one above (the same in every run): not shown again",
        ]
        return [*(table if len(table) > 2 else ["No figure moved."]), "", *(f"- {n}" for n in notes), ""]


# ---- running the variants -------------------------------------------------------------------------

# A tree installed again in its environment (editable: new modules found, the compiled one rebuilt).
REBUILD = ("-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e")


@dataclass(frozen=True)
class Variant:
    name: str
    python: str
    tree: str

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, eq, rest = spec.partition("=")
        python, colon, tree = rest.rpartition(":")
        if not (eq and colon and name and python and tree):
            raise SystemExit(f"--variant {spec!r}: expected NAME=PYTHON:TREE")
        return cls(name, python, os.fspath(Path(tree).resolve()))

    def commit(self) -> str:
        def git(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["git", "-C", self.tree, *args], capture_output=True, text=True, check=False
            )

        head = git("rev-parse", "--short", "HEAD").stdout.strip() or "an unknown commit"
        return head + (" with uncommitted changes" if git("diff", "--quiet", "HEAD").returncode else "")

    def check(self, rebuild: bool) -> None:
        """Its Python imports smstore from its tree, with a compiled module built since its C++ changed;
        `rebuild`: installed again first (incremental: seconds when nothing changed)."""
        if rebuild:
            log(f"variant {self.name}: installing its tree again")
            subprocess.run([self.python, *REBUILD, self.tree], check=True)
        probe = "import smstore, smstore._core as c; print(smstore.__file__); print(c.__file__)"
        out = subprocess.run([self.python, "-c", probe], capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"variant {self.name}: {self.python} cannot import smstore:\n{out.stderr}")
        package, module = out.stdout.split()
        if not Path(package).resolve().is_relative_to(self.tree):
            raise SystemExit(
                f"variant {self.name}: {self.python} imports smstore from {package}, not {self.tree}"
            )
        sources = [Path(self.tree, "CMakeLists.txt"), *Path(self.tree, "csrc").rglob("*.[ch]pp")]
        if max(p.stat().st_mtime for p in sources) > Path(module).stat().st_mtime:
            raise SystemExit(
                f"variant {self.name}: its compiled module is older than its csrc/: install the tree again "
                f"(--rebuild does): {' '.join([self.python, *REBUILD, self.tree])}"
            )

    def run(self, bench: Benchmark, out: Path, timeout: float) -> tuple[int | str, float]:
        """One run of a benchmark: its table in `out`, what it printed in `out`.log; (exit status, seconds)."""
        env = {**os.environ, "PATH": f"{Path(self.python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("VIRTUAL_ENV", None)
        script = os.path.join(self.tree, "benchmarks", bench.script)
        cmd = [self.python, script, *bench.args, "--out", os.fspath(out)]
        started = time.perf_counter()
        with open(f"{out}.log", "wb") as output:
            # A session of its own, so that on a timeout its daemons and ranks go with it.
            proc = subprocess.Popen(
                cmd, cwd=self.tree, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc: int | str = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"none: killed after {timeout:.0f} s"
        return rc, time.perf_counter() - started

    def anonymous(self, text: str, commit: str) -> str:
        """`text` naming this variant's tree and environment by its commit, not by their paths."""
        venv = os.fspath(Path(self.python).parent.parent)
        return text.replace(self.tree, f"<tree at {commit}>").replace(venv, f"<environment of {commit}>")


@dataclass
class Run:
    bench: str
    variant: str
    round: int
    page: str  # its results page, in the raw directory
    rc: int | str
    seconds: float


@dataclass
class Session:
    command: str
    date: str
    seconds: float
    load: tuple[float, float]
    machine: list[str]
    rounds: int
    variants: list[tuple[str, str, str]]  # name, commit, its runs' software line
    runs: list[Run]

    def report(self, raw: Path) -> str:
        names = [name for name, _commit, _software in self.variants]
        out = [
            f"# smstore's trees against each other: {', '.join(names)}",
            "",
            f"`{self.command}` on {self.date}, {self.seconds:.0f} s in all.",
            "",
            *self.machine,
            (
                f"- load average (1 min) before / after: {self.load[0]:.2f} / {self.load[1]:.2f}: a shared "
                "machine, so each figure's range is given beside its median"
            ),
            *(f"- {name}: git {commit}; {software}" for name, commit, software in self.variants),
            (
                f"- {self.rounds} rounds; in each, every benchmark run by each variant in turn "
                f"({', '.join(names)}, then the reverse in the next round), each variant running its own "
                f"tree's script with its own Python; ratios: a variant's median over {names[0]}'s; better or "
                "worse: every run of one on that side of every run of the other"
            ),
            "",
        ]
        for bench in BENCHMARKS:
            runs = [r for r in self.runs if r.bench == bench.name]
            if runs:
                out += self.section(raw, bench, runs, names)
        return "\n".join(out)

    def section(self, raw: Path, bench: Benchmark, runs: list[Run], names: list[str]) -> list[str]:
        tables = {bench.name: Comparison(names), **{title: Comparison(names) for _p, title in bench.split}}
        prefixes = tuple(p for p, _title in bench.split)
        failed: list[str] = []
        for r in runs:
            if r.rc != 0:
                tail = Path(raw, f"{r.page}.log").read_text(errors="replace").strip().splitlines()[-15:]
                failed += [
                    f"- {r.variant}, round {r.round + 1}: exit status {r.rc} after {r.seconds:.0f} s:",
                    "",
                ]
                failed += ["  ```", *(f"  {line}" for line in tail), "  ```", ""]
                continue
            rows = read_rows(Path(raw, r.page).read_text())
            tables[bench.name].add(r.variant, [row for row in rows if not row.metric.startswith(prefixes)])
            for prefix, title in bench.split:
                tables[title].add(r.variant, [row for row in rows if row.metric.startswith(prefix)])
        took = ", ".join(
            f"{n} {statistics.median(r.seconds for r in runs if r.variant == n):.0f} s" for n in names
        )
        out = [
            f"## {bench.name}: `{bench.script} {' '.join(bench.args)}`",
            "",
            f"A run's wall time (median): {took}.",
            "",
        ]
        if failed:
            out += [f"**Runs that failed** ({sum(r.rc != 0 for r in runs)} of {len(runs)}):", "", *failed]
        for title, comparison in tables.items():
            if comparison.rows:
                out += ([f"### {title}", ""] if title != bench.name else []) + comparison.lines()
        return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variant", action="append", default=[], help="NAME=PYTHON:TREE (repeat; the first is the baseline)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--only", action="append", choices=[b.name for b in BENCHMARKS], help="these benchmarks only (repeat)"
    )
    p.add_argument("--out", type=Path, default=HERE / "results" / "versus.md")
    p.add_argument("--raw", type=Path, help="keep every run's results page and output in this directory")
    p.add_argument("--from", dest="again", type=Path, help="the report again from a --raw directory")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    p.add_argument("--rebuild", action="store_true", help="install each tree in its environment again first")
    args = p.parse_args(argv)
    if args.again:
        saved = json.loads(Path(args.again, "session.json").read_text())
        session = Session(**{**saved, "runs": [Run(**r) for r in saved["runs"]]})
        text = session.report(args.again)
    else:
        variants = [Variant.parse(s) for s in args.variant]
        if len(variants) < 2 or len({v.name for v in variants}) < len(variants):
            raise SystemExit("give two --variant NAME=PYTHON:TREE or more, each its own name")
        for v in variants:
            v.check(args.rebuild)
        text = run_session(args, variants, sys.argv[1:] if argv is None else list(argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


def run_session(args: argparse.Namespace, variants: list[Variant], argv: list[str]) -> str:
    commits = {v.name: v.commit() for v in variants}

    def anonymous(text: str) -> str:
        for v in variants:
            text = v.anonymous(text, commits[v.name].split()[0])
        return text

    benches = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    load, started = os.getloadavg()[0], time.perf_counter()
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        raw = args.raw or stack.enter_context(temp_dir(None))
        raw.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            for bench in benches:
                # Each round takes the variants in the other order: a drift of the machine hits all alike.
                for v in variants if r % 2 == 0 else variants[::-1]:
                    log(f"round {r + 1} of {args.rounds}: {bench.name}, {v.name}")
                    page = f"{bench.name}-{v.name}-{r + 1}.md"
                    rc, seconds = v.run(bench, raw / page, args.timeout)
                    runs.append(Run(bench.name, v.name, r, page, rc, seconds))
                    if rc != 0:
                        log(f"  failed (exit status {rc}) after {seconds:.0f} s: {raw / page}.log")
        software = {}
        for v in variants:
            done = [Path(raw, x.page).read_text() for x in runs if x.variant == v.name and x.rc == 0]
            lines = [x[2:] for page in done for x in page.splitlines() if x.startswith("- software:")]
            software[v.name] = lines[0] if lines else "no run wrote its software"
        session = Session(
            command=command_line("python benchmarks/versus.py", [anonymous(a) for a in argv]),
            date=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
            seconds=time.perf_counter() - started,
            load=(load, os.getloadavg()[0]),
            machine=machine_info(raw)[:1],
            rounds=args.rounds,
            variants=[(v.name, commits[v.name], software[v.name]) for v in variants],
            runs=runs,
        )
        # The logs quoted name the variants' trees by commit; the rest is made portable as every results page.
        for run in runs:
            output = Path(raw, f"{run.page}.log")
            output.write_text(portable(anonymous(output.read_text(errors="replace"))))
        Path(raw, "session.json").write_text(json.dumps(asdict(session), indent=1))
        return portable(session.report(raw))


if __name__ == "__main__":
    sys.exit(main())
