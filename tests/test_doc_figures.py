"""Every figure README.md and docs/benchmarks.md quote from a results file is in that file.

The convention (docs/development.md, "Tests that keep the docs honest"):

- A block is a paragraph, a list item, or a table. A block cites a results file when it
  names `bench/results/NAME.json` (in backticks, as a Markdown link, or as a bare path); a
  table also cites what its caption (the paragraph right above it, or the caption of a
  table right above it) cites.
- Every figure of a citing block must be a value of a file it cites, within the rounding of
  its printed digits: a number with a decimal point or a thousands separator, a number with
  a unit (`x`, `%`, `s`, `ms`, `GB`, `MiB`, `tokens/s`, ...), and in a table every cell
  that holds only numbers. A figure may be the file's value in the unit printed (a fraction
  as a percentage, bytes as GB / GiB / MB / MiB, MB as GB, seconds as ms), a ratio of two
  of its summary values of one kind (tokens/s of two rows, or of one row in two files), a
  share of a breakdown (a profile's parts), or a median pooled over the rounds of several
  cited files.
- Not figures: code spans, dates and clock times, version numbers, names with digits
  (`v5e-4`, `llama3.1-8b`, `bf16`), bare integers in prose (layers, rounds, an issue's
  number), approximations written with `~` or "about", and targets written with `>=` / `<=`.

A results file a later run overwrote is kept as `bench/results/history/COMMIT/NAME.json`,
the file as COMMIT recorded it, and the doc cites that.
A figure that no results file holds does not cite one: its block sits in docs/benchmarks.md's
last section, "Figures without a kept results file (not checked)", under a line that says
which run (commit or date) it is from. Everywhere else a block that quotes a figure cites a results file.
Nothing here imports JAX; the test reads Markdown and JSON only.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import statistics
from dataclasses import dataclass
from functools import cache
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/benchmarks.md")
UNCHECKED = "Figures without a kept results file (not checked)"  # a heading of docs/benchmarks.md

CITATION = re.compile(r"bench/results/[\w./-]*?\.json")
UNIT = r"(?:x|%|[ \u00a0]?(?:tokens/s|GFLOP/s|TFLOP/s|MB/s|GB/s|ms|us|s|min|GB|MB|KB|GiB|MiB|KiB|TFLOP|GFLOP))"
# A number: thousands separators or a plain run of digits, an optional fraction, then an
# optional unit; not glued to a word or a path on either side (`bf16`, `v5e-4`, `x86_64`).
NUMBER = re.compile(
    r"(?:(?<![\w.\-/~^])|(?<=\d-))(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    rf"(?P<unit>{UNIT})?(?![\w/]|\.\d|-[A-Za-z])"
)
NOT_FIGURES = [
    re.compile(r"`[^`]*`"),  # code spans: commands, paths, config keys
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"\d{4}-\d{2}-\d{2}"),  # dates
    re.compile(r"\d{1,2}:\d{2}(?: UTC)?"),  # clock times
    re.compile(r"\d+(?:\.\d+){2,}"),  # version numbers
    re.compile(
        r"(?i)\b(?:torch|jax|libtpu|orbax|python|prefect|maxtext|bubblewrap|transformers|"
        r"tokenizers|zen|family|model|issue|issues|session)\s+\d+(?:\.\d+)*"
    ),
    re.compile(r"(?:~|\babout)\s*[\d,.]+"),  # approximations
    re.compile(r"(?:>=|<=|\u2265|\u2264)\s*[\d,.]+"),  # targets, not measurements
]
STATS = {"median", "min", "max", "n", "spread", "values", "mean"}
SCALES = (1.0, 100.0, 1e-3, 1 / 1024, 1e3, 1e-6, 1e-9, 2.0**-20, 2.0**-30)
MAX_GROUP = 12  # ratios are taken within groups of at most this many values


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    text: str
    is_table: bool
    caption: str = ""  # a table's: the paragraph right above it


def blocks(doc: str, text: str | None = None) -> list[Block]:
    """Paragraphs, list items and tables of a Markdown file, code blocks and headings left out."""
    text = (ROOT / doc).read_text() if text is None else text
    out: list[Block] = []
    current: list[str] = []
    start, kind = 0, ""  # kind: "para", "item" or "table"
    fenced = False
    barrier = True  # a heading or a code block since the last block: no caption across it

    def flush() -> None:
        nonlocal barrier
        if current:
            above = None if barrier or not out else out[-1]
            caption = ""
            if kind == "table" and above is not None:  # a table right below another shares its caption
                caption = above.caption if above.is_table else above.text
            out.append(Block(doc, start + 1, "\n".join(current), kind == "table", caption))
            barrier = False
        current.clear()

    for i, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if stripped.startswith("```") or fenced or stripped.startswith("#"):
            flush()
            barrier = True
            fenced ^= stripped.startswith("```")
            continue
        if not stripped:
            flush()
            continue
        starts_item = re.match(r"([-*]|\d+\.)\s", stripped) is not None
        if stripped.startswith("|"):
            this = "table"
        elif starts_item:
            this = "item"
        elif kind == "table" or not current:
            this = "para"
        else:
            this = kind  # a continuation line
        if not current or this != kind or starts_item:
            flush()
            start, kind = i, this
        current.append(line)
    flush()
    return out


def citations(doc: str, text: str | None = None) -> list[tuple[Block, list[str]]]:
    """Each citing block with the files it cites (a table: its own and its caption's)."""
    out = []
    for block in blocks(doc, text):
        cited = CITATION.findall(block.caption) + CITATION.findall(block.text)
        cited = [c for c in cited if "NAME" not in c]  # a placeholder, as in "writes NAME.json"
        if cited:
            out.append((block, list(dict.fromkeys(cited))))
    return out


def figures(block: Block) -> list[str]:
    """The figures a block quotes, as printed (`1,147`, `0.77x`, `9.8%`)."""
    if block.is_table:
        cells = [c.strip() for row in block.text.splitlines() for c in row.strip().strip("|").split("|")]
        # A cell of figures: "1,147 (9.8%)", "**0.77x**", "1.86 GB", "6.65-6.8 s", "0.97x (3,073
        # vs 3,166)"; a label ("torch 2.13", "2,048 positions") is not one.
        bare = [re.sub(r"[*_]", "", c) for c in cells]
        is_figures = [re.sub(rf"[\d,.]+{UNIT}?|\b(?:vs|against)\b|[\s()/;-]", "", c) == "" for c in bare]
        return [m.group(0) for c, yes in zip(bare, is_figures, strict=True) if yes and c for m in NUMBER.finditer(c)]
    text = block.text
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    return [m.group(0) for m in NUMBER.finditer(text) if m.group("unit") or re.search(r"[.,]", m.group("num"))]


Leaf = tuple[tuple[str, ...], float]


@cache
def leaves(path: str) -> tuple[Leaf, ...]:
    """A results file's numbers, each with its trail of keys (list positions as "[i]")."""
    out: list[Leaf] = []

    def walk(node: object, trail: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*trail, str(key)))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, (*trail, f"[{i}]"))
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            out.append((trail, float(node)))

    walk(json.loads((ROOT / path).read_text()), ())
    return tuple(out)


Candidates = dict[str, list[float]]


@cache
def cited_values(cited: tuple[str, ...]) -> Candidates:
    """What a block citing these files may quote, by kind: "value" (the files' summary values
    and medians pooled over their rounds), "scaled" (every value, also in other units: bytes
    as GB / GiB / MB / MiB, MB as GB, seconds as ms and back), "ratio" (two like summary
    values, divided) and "percent" (a fraction, a ratio or a share of a breakdown, x 100)."""
    all_leaves = [leaf for path in cited for leaf in leaves(path)]
    summary: list[Leaf] = []
    # Pooled: the median over the rounds of two or more of the files ("pooled, 6 rounds").
    for size in range(2, len(cited) + 1):
        for subset in combinations(cited, size):
            pooled: dict[tuple[str, ...], list[float]] = {}
            for path in subset:
                for trail, v in leaves(path):
                    if len(trail) > 1 and trail[-2] == "values":
                        pooled.setdefault(trail[:-1], []).append(v)
            summary += [((*k, "pooled", *subset), statistics.median(v)) for k, v in pooled.items()]
    for trail, v in all_leaves:
        last = trail[-1] if trail else ""
        raw = last in STATS - {"median"} or last.startswith("[")  # a statistic or a round's sample
        if v and not raw and not any("load" in k for k in trail):
            summary.append((trail, v))
    value = [v for _, v in summary]  # no load average or single round passes for a ratio
    scaled = [v * s for _, v in all_leaves + summary for s in SCALES]
    percent = [100 * v for trail, v in all_leaves if not trail[-1].startswith("[") and "load" not in trail[-1]]
    # Shares: a value over the sum of its siblings (a profile's parts).
    siblings: dict[tuple[str, ...], list[float]] = {}
    for path in cited:
        for trail, v in leaves(path):
            siblings.setdefault((path, *trail[:-1]), []).append(v)
    for group in siblings.values():
        total = sum(group)
        if 2 < len(group) <= MAX_GROUP and total > 0:
            percent += [100 * v / total for v in group]
    # Ratios of two summary values of one kind: their trails differ in one key (two rows'
    # medians, engine against transformers, one file against another), never in a statistic.
    groups: dict[tuple[str, ...], set[float]] = {}
    for trail, v in summary:
        if "runs" in trail and "pooled" not in trail:
            continue  # one round of several: its ratios are noise, and no doc quotes them
        kind = tuple("[]" if k.startswith("[") else k for k in trail)
        groups.setdefault(kind, set()).add(v)
        # The key that differs names a row or a side, never the quantity (the last key that
        # is not a statistic): tokens/s are not divided by megabytes.
        quantity = max((i for i, k in enumerate(trail) if k not in STATS and not k.startswith("[")), default=0)
        for i, key in enumerate(trail[:quantity]):
            if key not in STATS and not key.startswith("["):
                groups.setdefault((*kind[:i], "*", *kind[i + 1 :]), set()).add(v)
    ratio = [1.0]  # a peer against itself
    for group in groups.values():
        if 1 < len(group) <= MAX_GROUP:
            for x, y in combinations(sorted(group), 2):
                ratio += [x / y, y / x]
    percent += [100 * r for r in ratio]
    return {"value": sorted(value), "scaled": sorted(scaled), "ratio": sorted(ratio), "percent": sorted(percent)}


# Which kinds of candidates a figure printed with a unit may be.
KINDS = {
    "x": ("value", "ratio"),
    "%": ("value", "percent"),
    "": ("scaled",),  # a table's cells take their unit from the header
}


def matches(figure: str, candidates: Candidates) -> bool:
    m = NUMBER.fullmatch(figure.replace("\u00a0", " "))
    assert m, figure
    num = m.group("num").replace(",", "")
    decimals = len(num.split(".")[1]) if "." in num else 0
    q = float(num)
    tolerance = 0.5 * 10**-decimals * (1 + 1e-9)
    unit = (m.group("unit") or "").strip()
    kinds = KINDS.get(unit, ("scaled",))
    for kind in kinds:  # each list is sorted: is there a value within the rounding of q?
        values = candidates[kind]
        i = bisect.bisect_left(values, q - tolerance)
        if i < len(values) and values[i] <= q + tolerance:
            return True
    return False


def unmatched(block: Block, cited: list[str]) -> list[str]:
    quoted = figures(block)
    missing_files = [c for c in cited if not (ROOT / c).is_file()]
    if quoted and missing_files:
        return [f"cites {c}, which does not exist" for c in missing_files]
    candidates = cited_values(tuple(c for c in cited if c not in missing_files))
    return [fig for fig in quoted if not matches(fig, candidates)]


def cites(block: Block) -> bool:
    return any("NAME" not in c for c in CITATION.findall(block.caption) + CITATION.findall(block.text))


RUN = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|`[0-9a-f]{7,40}`")  # a date or a commit: which run


def headings(text: str) -> list[tuple[int, int, str]]:
    """(1-based line, level, title) of each heading outside code blocks."""
    out = []
    fenced = False
    for i, line in enumerate(text.splitlines()):
        fenced ^= line.strip().startswith("```")
        m = re.match(r"(#+)\s+(.*)", line)
        if m and not fenced:
            out.append((i + 1, len(m.group(1)), m.group(2).strip()))
    return out


def unchecked_ranges(text: str) -> list[tuple[int, int]]:
    """The UNCHECKED section's lines: from its heading to the next of its level or above."""
    heads = headings(text)
    out = []
    for k, (start, level, title) in enumerate(heads):
        if title == UNCHECKED:
            end = next((h for h, lv, _ in heads[k + 1 :] if lv <= level), len(text.splitlines()) + 1)
            out.append((start, end))
    return out


def uncited(doc: str, text: str | None = None) -> list[Block]:
    """Blocks that quote a figure and cite no results file, outside the UNCHECKED section."""
    text = (ROOT / doc).read_text() if text is None else text
    exempt = unchecked_ranges(text)
    return [b for b in blocks(doc, text) if not cites(b) and figures(b) and not any(a < b.line < z for a, z in exempt)]


def unsourced(doc: str, text: str | None = None) -> list[Block]:
    """Blocks of the UNCHECKED section that quote a figure with no date or commit, in
    themselves or in a block before them under the same heading, to say which run it was."""
    text = (ROOT / doc).read_text() if text is None else text
    exempt = unchecked_ranges(text)
    heads = [h for h, _, _ in headings(text)]
    out, named_under = [], None  # the heading under which a run was last named
    for b in blocks(doc, text):
        if not any(a < b.line < z for a, z in exempt):
            continue
        heading = max((h for h in heads if h < b.line), default=0)
        if RUN.search(b.text):
            named_under = heading
        elif figures(b) and named_under != heading:
            out.append(b)
    return out


CASES = [(block, cited) for doc in DOCS for block, cited in citations(doc)]


def test_the_docs_cite_results_files():
    # A parser that found nothing would pass everything below.
    assert sum(block.doc == "docs/benchmarks.md" for block, _ in CASES) > 30
    assert any(block.is_table for block, _ in CASES)


@pytest.mark.parametrize(("block", "cited"), CASES, ids=[f"{b.doc}:{b.line}" for b, _ in CASES])
def test_cited_figures_are_in_the_file(block: Block, cited: list[str]):
    missing = unmatched(block, cited)
    assert not missing, (
        f"{block.doc}:{block.line} quotes figures that {', '.join(cited)} does not hold: "
        f"{', '.join(missing)} (docs/development.md, 'Tests that keep the docs honest')"
    )


@pytest.mark.parametrize("doc", DOCS)
def test_measured_figures_cite_a_results_file(doc: str):
    bare = uncited(doc)
    assert not bare, (
        f"{doc}: these blocks quote figures and cite no results file: "
        + "; ".join(f"line {b.line} ({', '.join(figures(b)[:4])})" for b in bare)
        + (
            f". Cite the bench/results file that holds them (a later run overwrote it: restore it as "
            f"bench/results/history/COMMIT/NAME.json), or, where no file ever held them, move the "
            f"block to docs/benchmarks.md's '{UNCHECKED}' naming the run it is from "
            f"(docs/development.md, 'Tests that keep the docs honest')"
        )
    )


def test_unchecked_figures_name_their_run():
    for doc in DOCS:
        bare = unsourced(doc)
        assert not bare, f"{doc}: under '{UNCHECKED}', these blocks name no run (a date or a commit): " + ", ".join(
            f"line {b.line}" for b in bare
        )


def test_an_uncited_figure_fails_outside_the_unchecked_section():
    text = (
        "# Bench\n\nThe step took 1.86 s (`bench/results/train_throughput.json`).\n\n"
        "An in-process A/B read 0.84x.\n\n| step |\n|--:|\n| 6.8 s |\n\n"
        "Layers: 6, issue 18, ~80 GFLOP/s, target >= 1.0x.\n\n"
        f"## {UNCHECKED}\n\n### Training\n\nWritten at `abc1234` (2026-12-01):\n\n0.84x.\n\n"
        "### Sampling\n\nA run read 3.05x.\n\n"
        "## After\n\nThen 0.92x.\n"
    )
    assert [b.line for b in uncited("x.md", text)] == [5, 7, 27]
    # Under its own heading, a figure with no date or commit before it says nothing of its run.
    assert [b.line for b in unsourced("x.md", text)] == [23]


# docs/benchmarks.md's first Xeon table as issue 48 found it: it cited a file a later run had
# overwritten.
DRIFTED = """\
`python -m bench.train_throughput --steps 8 --warmup 2 --repeats 3`, engine and torch
alternating; load 0.96 at the start (`bench/results/train_throughput.json`):

| framework | dtype | tokens/s (spread) | MFU vs its dtype's matmul peak | peak RSS | vs torch | RSS vs torch |
|-----------|-------|------------------:|-----:|---------:|---------:|-------------:|
| engine | f32 | 1,147 (9.8%) | 59.4% | 1.86 GB | **0.77x** | 0.73x |
| torch 2.13 | f32 | 1,482 (7.4%) | - | 2.54 GB | 1.00x | 1.00x |
| engine | bf16 | 1,780 (9.5%) | 20.5% | 1.88 GB | **0.70x** | 0.97x |
| torch 2.13 | bf16 | 2,552 (13.0%) | - | 1.93 GB | 1.00x | 1.00x |
"""


def test_a_table_citing_an_overwritten_file_fails():
    (table, cited), *_ = [case for case in citations("drifted.md", DRIFTED) if case[0].is_table]
    assert cited == ["bench/results/train_throughput.json"]
    assert {"1,147", "1,482", "59.4%", "0.77x"} <= set(unmatched(table, cited))
    # The file as the run recorded it holds every figure of the table.
    kept = DRIFTED.replace("bench/results/train_throughput.json", "bench/results/history/c9f80a4/train_throughput.json")
    (table, cited), *_ = [case for case in citations("kept.md", kept) if case[0].is_table]
    assert figures(table) and unmatched(table, cited) == []


def test_what_counts_as_a_figure():
    text = (
        "On 2026-12-01 (08:26 UTC, jax 0.12.0.1, issue 18, a 2-core v5e-4, `--repeats 3`, "
        "8 x 512 rows, ~80 GFLOP/s) the engine read 1,576-1,773 tokens/s, **0.77x**, 9.8%, "
        "1.86 GB and 0.96."
    )
    assert figures(Block("x.md", 1, text, False)) == ["1,576", "1,773 tokens/s", "0.77x", "9.8%", "1.86 GB", "0.96"]
    table = "| framework | step | rows |\n|---|--:|--:|\n| engine 2.13 | 6.65-6.8 s | **4** |"
    assert figures(Block("x.md", 1, table, True)) == ["6.65", "6.8 s", "4"]


def test_derived_figures(tmp_path):
    run = {
        "rows": [
            {
                "tokens_per_second": {"median": 1147.4, "values": [1100.0, 1147.4, 1200.0], "spread": 0.098},
                "peak_rss_mb": {"median": 1860.2},
            },
            {
                "tokens_per_second": {"median": 1482.0, "values": [1400.0, 1482.0, 1500.0], "spread": 0.074},
                "peak_rss_mb": {"median": 2540.0},
            },
        ],
        "parts_ms": {"mlp": 30.0, "attention": 60.0, "rest": 10.0},
    }
    other = {"rows": [{"tokens_per_second": {"median": 1000.0, "values": [990.0, 1000.0, 1010.0]}}]}
    (tmp_path / "a.json").write_text(json.dumps(run))
    (tmp_path / "b.json").write_text(json.dumps(other))
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")

    def check(text: str, *cited: str) -> list[str]:
        return unmatched(Block("x.md", 1, text, False), list(cited))

    # Rounded to the printed digits, thousands separators, a spread as a percentage, MB as
    # GB, a ratio of two rows' medians, a share of a breakdown.
    assert check("1,147 tokens/s (9.8%), 1.86 GB, 0.77x, RSS 0.73x, 1.29x, 60.0% and 30%", a) == []
    # Pooled over two files' rounds: the median of six.
    assert check("pooled 1,055 tokens/s, 1.15x against the other file", a, b) == []
    assert check("pooled 1,055 tokens/s", a) == ["1,055 tokens/s"]
    # What the file does not hold, by more than the printed rounding, is named.
    assert check("1,149 tokens/s, 0.78x, 9.9%, 1.85 GB and 61.0%", a) == [
        "1,149 tokens/s",
        "0.78x",
        "9.9%",
        "1.85 GB",
        "61.0%",
    ]
    assert check("1.00x", str(tmp_path / "missing.json")) == [f"cites {tmp_path}/missing.json, which does not exist"]
