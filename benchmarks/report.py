"""The tables and plots of a ``python -m benchmarks`` run.

Again from a run's JSON: ``python -m benchmarks.report benchmarks/results/contenders-DATE.json [docs/benchmarks.md]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
REF = "smstore-mmap"  # ratios are to smstore (file mapping) unless said
OBJ_REF = "obj-sharedlist"


def _label(results: dict[str, Any], key: str) -> str:
    return str(results["contenders"].get(key, {}).get("label", key))


def _ratio(x: float | None, ref: float | None) -> str:
    if x is None or not ref:
        return "-"
    return f"{x / ref:.2f}x"


def _ns(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _spread(m: dict[str, float]) -> str:
    return f"{_ns(m['median'])} ({_ns(m['min'])}-{_ns(m['max'])})"


def _memory_table(results: dict[str, Any], key: str, ref: str) -> list[str]:
    rows = results[key]
    if not rows:
        return []
    grid = sorted({(r["ranks"], r["workers"]) for r in rows})
    by = {(r["contender"], r["ranks"], r["workers"]): r for r in rows}
    keys = list(dict.fromkeys(r["contender"] for r in rows))
    head = "| contender | " + " | ".join(f"R={r} K={k}" for r, k in grid) + " |"
    out = [head[:-1] + "| reaches the bytes by |", "|---|" + "---|" * (len(grid) + 1)]
    for c in keys:
        cells = []
        for r, k in grid:
            row = by.get((c, r, k))
            cells.append("-" if row is None else f"{row['x_raw']:.2f}")
        access = results["contenders"].get(c, {}).get("access", "?")
        out.append(f"| {_label(results, c)} | " + " | ".join(cells) + f" | {access} |")
    out += ["", "Loader throughput, records/s (slowest rank's epoch), and ratio to smstore:", ""]
    out += [head, "|---|" + "---|" * len(grid)]
    for c in keys:
        cells = []
        for r, k in grid:
            row, base = by.get((c, r, k)), by.get((ref, r, k))
            if row is None:
                cells.append("-")
            else:
                cells.append(
                    f"{row['records_s']:,.0f} ({_ratio(row['records_s'], base and base['records_s'])})"
                )
        out.append(f"| {_label(results, c)} | " + " | ".join(cells) + " |")
    return out


def _scaling(results: dict[str, Any], key: str) -> dict[str, dict[int, float]]:
    """Steady records/s by worker count, from the R=1 jobs (the largest K of the grid wins)."""
    out: dict[str, dict[int, float]] = {}
    for r in sorted(results[key], key=lambda r: r["workers"]):
        if r["ranks"] == 1 and r.get("steady_records_s"):
            out.setdefault(r["contender"], {}).update({int(k): v for k, v in r["steady_records_s"].items()})
    return out


def _scaling_table(results: dict[str, Any], key: str, ref: str) -> list[str]:
    curve = _scaling(results, key)
    if not curve:
        return []
    ks = sorted({k for c in curve.values() for k in c})
    out = [
        "",
        (
            "Scaling with the number of workers (R=1): records/s after the first batch (worker start-up "
            "left out), a few seconds of the epoch for the smaller counts; ratio to smstore:"
        ),
        "",
        "| contender | " + " | ".join(f"K={k}" for k in ks) + " | K=max / K=1 |",
        "|---|" + "---|" * (len(ks) + 1),
    ]
    for c, by_k in curve.items():
        cells = []
        for k in ks:
            v, base = by_k.get(k), curve.get(ref, {}).get(k)
            cells.append("-" if v is None else f"{v:,.0f} ({_ratio(v, base)})")
        gain = f"{by_k[ks[-1]] / by_k[ks[0]]:.2f}x" if ks[0] in by_k and ks[-1] in by_k else "-"
        out.append(f"| {_label(results, c)} | " + " | ".join(cells) + f" | {gain} |")
    return out


def markdown(results: dict[str, Any]) -> str:
    m, v, d, p = results["machine"], results["versions"], results["data"], results["params"]
    objects = ""
    if "objects" in d:
        objects = (
            f"; objects: {d['objects']:,} COCO-like dicts made in every rank, "
            f"{d['objects_pickled_bytes'] / MiB:.1f} MiB pickled"
        )
    out = [
        "# smstore against the alternatives",
        "",
        f"- command: `{results['command']}` ({results['preset']} preset), {results['date']}, git {m['git']}",
        (
            f"- machine: {m['cpus']} CPUs `{m['cpu']}`, {m['ram_gib']} GiB RAM, Linux {m['kernel']}, "
            f"load average before {m['load_before']}"
        ),
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        (
            f"- data: {d['records']:,} records, each {p['lines_per_record']} non-empty lines of the Python "
            f"standard library's sources joined by spaces: {d['raw_bytes'] / MiB:.1f} MiB of record bytes"
            f"{objects}"
        ),
        (
            f"- timing: {p['repeats']} timed rounds after a warm-up round, median (min-max); batches of "
            f"{p['batch_size']}; section times: "
            + ", ".join(f"{k} {t:.0f} s" for k, t in results.get("seconds", {}).items())
        ),
        "",
    ]
    if results["skipped"]:
        out += ["**Skipped** (reported, not dropped):", ""]
        out += [f"- {_label(results, k)}: {why}" for k, why in results["skipped"].items()]
        out.append("")
    reads = results["reads"]
    if reads:
        ref = reads.get(REF)
        out += [
            "## Random reads (ns/record, one process, ratio to smstore mmap)",
            "",
            "| contender | single `get(i)` | ratio | batched | ratio | batched access of its own | indices a round |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, t in reads.items():
            s, b = t["single"], t["batch"]
            own = "yes" if results["contenders"][key]["batched"] else "no (a loop of get)"
            out.append(
                f"| {_label(results, key)} | {_spread(s)} | {_ratio(s['median'], ref and ref['single']['median'])} "
                f"| {_spread(b)} | {_ratio(b['median'], ref and ref['batch']['median'])} | {own} "
                f"| {t['indices']:,} |"
            )
        out.append("")
    if results["memory"]:
        out += [
            "## Memory: summed PSS of every process over the raw data size",
            "",
            (
                "R ranks x K DataLoader workers (fork), one shuffled epoch each, every byte read; PSS summed "
                "over every rank and worker (and the daemon) with all alive, minus the same job over as many "
                "one-byte records (the same length, sampler and loader), over the difference in record bytes. 1.00 = one copy of the data on the node."
            ),
            "",
            *_memory_table(results, "memory", REF),
            *_scaling_table(results, "memory", REF),
            "",
        ]
    if results["objects"]:
        out += [
            "## Records as objects (lists of dicts): memory over one pickled copy",
            "",
            *_memory_table(results, "objects", OBJ_REF),
            "",
        ]
    first = results["first"]
    if first:
        ref = first.get(REF, {}).get("median_s")
        null = first.get("null", {}).get("median_s", 0.0)
        out += [
            "## Time to the first record in a fresh process",
            "",
            (
                "Wall time of `python -c` that imports the contender, opens its store and reads one random "
                f"record (median of {p['first_repeats']}). The empty-records reader takes {null * 1e3:.0f} ms "
                "(interpreter, numpy, smstore): every row includes it."
            ),
            "",
            "| contender | ms (min-max) | ratio |",
            "|---|---|---|",
        ]
        for key, t in first.items():
            if key != "null":
                out.append(
                    f"| {_label(results, key)} | {t['median_s'] * 1e3:.0f} ({t['min_s'] * 1e3:.0f}-"
                    f"{t['max_s'] * 1e3:.0f}) | {_ratio(t['median_s'], ref)} |"
                )
        out.append("")
    build = results["build"]
    if build:
        ref = build.get(REF, {}).get("mib_s")
        out += [
            "## Build from the text file, and size on disk",
            "",
            "| contender | MiB/s of text | ratio | on disk | x text |",
            "|---|---|---|---|---|",
        ]
        for key, t in build.items():
            out.append(
                f"| {_label(results, key)} | {t['mib_s']:.1f} | {_ratio(t['mib_s'], ref)} | "
                f"{t['disk'] / MiB:.1f} MiB | {t['disk'] / d['text_bytes']:.2f} |"
            )
        out.append("")
    return "\n".join(out)


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots: memory and throughput against processes, read latency. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = plt.get_cmap("tab20").colors
    markers = "osD^vP*Xh<>p"
    titles = {"memory": "records as bytes", "objects": "records as objects (dicts)"}
    for key in ("memory", "objects"):
        rows = results[key]
        if not rows:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
        for n, c in enumerate(dict.fromkeys(r["contender"] for r in rows)):
            mine = sorted(
                (r for r in rows if r["contender"] == c),
                key=lambda r: (r["ranks"] * r["workers"], r["ranks"]),
            )
            xs = [f"{r['ranks']}x{r['workers']}" for r in mine]
            style = {
                "marker": markers[n % len(markers)],
                "color": colors[(2 * n) % 20 if n < 10 else (2 * n + 1) % 20],
                "lw": 3 if "smstore" in _label(results, c).lower() else 1.5,
                "label": _label(results, c),
            }
            ax1.plot(xs, [r["x_raw"] for r in mine], **style)
            ax2.plot(xs, [r["records_s"] for r in mine], **style)
        ax1.set(
            xlabel="ranks x workers",
            ylabel="summed PSS / raw data",
            title=f"{titles[key]}: memory (lower is better)",
        )
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax2.set(
            xlabel="ranks x workers",
            ylabel="records/s (log)",
            title=f"{titles[key]}: loader throughput (higher is better)",
        )
        ax2.set_yscale("log")
        ax2.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = out / f"contenders-{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    curve = _scaling(results, "memory")
    if curve:
        fig, ax = plt.subplots(figsize=(9, 5))
        for n, (c, by_k) in enumerate(curve.items()):
            ks = sorted(by_k)
            ax.plot(
                ks,
                [by_k[k] for k in ks],
                marker=markers[n % len(markers)],
                color=colors[(2 * n) % 20 if n < 10 else (2 * n + 1) % 20],
                lw=3 if "smstore" in _label(results, c).lower() else 1.5,
                label=_label(results, c),
            )
        ax.set(xlabel="DataLoader workers (one rank)", ylabel="records/s (log)", title="loader scaling")
        ax.set_yscale("log")
        ax.set_xticks(sorted({k for v in curve.values() for k in v}))
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = out / "contenders-scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    reads = results["reads"]
    if reads:
        keys = list(reads)
        fig, ax = plt.subplots(figsize=(11, 5))
        ys = range(len(keys))
        single = [reads[k]["single"]["median"] for k in keys]
        batch = [reads[k]["batch"]["median"] for k in keys]
        ax.barh([y + 0.2 for y in ys], single, height=0.4, label="single get(i)")
        ax.barh([y - 0.2 for y in ys], batch, height=0.4, label="batched (256)")
        ax.set_yticks(list(ys), [_label(results, k) for k in keys])
        ax.set_xscale("log")
        ax.set(xlabel="ns/record (log, lower is better)", title="random reads, one process")
        ax.invert_yaxis()
        ax.legend()
        fig.tight_layout()
        path = out / "contenders-reads.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


BEGIN, END = "<!-- results: written by python -m benchmarks -->", "<!-- end of results -->"


def publish(text: str, images: list[Path], docs: Path) -> None:
    """Put a run's tables and plots into docs/benchmarks.md, between its two result markers."""
    page = docs.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{docs}: the markers {BEGIN!r} and {END!r} are missing")
    body = text.split("\n", 1)[1].replace("\n## ", "\n### ")  # under the page's own headings
    pics = [f"![{p.stem}]({os.path.relpath(p, docs.parent)})" for p in images]
    before, rest = page.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    docs.write_text(f"{before}{BEGIN}\n{body.strip()}\n\n" + "\n\n".join(pics) + f"\n\n{END}{after}")


def write_report(results: dict[str, Any], out: Path, docs: Path | None = None) -> None:
    """contenders.md and the PNG plots under ``out``; with ``docs``, that page gets them too."""
    text = markdown(results)
    (out / "contenders.md").write_text(text + "\n")
    print(text)
    images: list[Path] = []
    try:
        images = plots(results, out)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install '.[bench]')", file=sys.stderr)
    for path in images:
        print(f"wrote {path}", file=sys.stderr)
    if docs is not None:
        publish(text, images, docs)
        print(f"wrote {docs}", file=sys.stderr)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    write_report(json.loads(path.read_text()), path.parent, Path(sys.argv[2]) if len(sys.argv) > 2 else None)
