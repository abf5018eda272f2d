"""The explain report's HTML as a real browser renders it: headless Chromium's DOM and a screenshot.

The DOM that Chromium dumps is parsed back into sections and tables and compared with the report's
own data (``ExplainReport.sections()``), so a tag the browser had to repair, a lost row or a number
that did not survive escaping fails here. Skipped only when no Chromium binary is on PATH; CI
installs Debian's ``chromium`` package, so there it runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from PIL import Image

from ember.report.explain import COMPUTE, STAGES, ExplainReport, explain_with

BROWSER = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason="no Chromium binary on PATH (chromium, chromium-browser or google-chrome); "
                            "install Debian's package: apt-get install -y chromium")

SECTIONS = ["Summary", "Host time per step, and what ran outside the graphs", "Compile time", "Ops by category", "Placement", "Fusion decisions", "Memory layout",
            "Matmul padding", "Merged matmuls", "Fallback ops", "Coverage", "Tuning", "Graphs"]
WIDTH, HEIGHT = 1200, 2000
MS = re.compile(r"^\d+\.\d ms$")
PCT = re.compile(r"^\d+\.\d%$")
INT = re.compile(r"^\d+$")
# Chromium logs each console message as "...:INFO:CONSOLE:1] "text", source: ..." (older: CONSOLE(1)).
CONSOLE = re.compile(r":CONSOLE[:(]")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.lin(x)))


# -- the browser ---------------------------------------------------------------------------------

def _browser(tmp: Path, *flags: str, url: str) -> subprocess.CompletedProcess:
    assert BROWSER is not None
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"  # one fresh profile per start
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", *flags, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def _script_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if CONSOLE.search(ln) or "Uncaught" in ln]


# -- the rendered DOM, parsed back -----------------------------------------------------------------

@dataclass
class Cell:
    text: str
    classes: set[str]


@dataclass
class DomTable:
    caption: str = ""
    headers: list[Cell] = field(default_factory=list)
    rows: list[tuple[set[str], list[Cell]]] = field(default_factory=list)  # row classes, cells


@dataclass
class DomSection:
    heading: str = ""
    classes: set[str] = field(default_factory=set)
    lines: list[tuple[str, set[str]]] = field(default_factory=list)  # p text, p classes
    tables: list[DomTable] = field(default_factory=list)


class _Dom(HTMLParser):
    """Top-level sections of the page with their heading, paragraphs and tables (not those inside
    <details>, which are per-graph), plus every tag name seen and the page's title and h1."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[DomSection] = []
        self.tags: list[str] = []
        self.title = self.h1 = ""
        self.details = 0
        self._open: list[str] = []
        self._text: list[str] | None = None
        self._classes: set[str] = set()
        self._row: tuple[set[str], list[Cell]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        classes = set((dict(attrs).get("class") or "").split())
        if tag == "details":
            self.details += 1
        inside = "details" in self._open
        if tag == "section":
            self.sections.append(DomSection(classes=classes))
        elif tag in ("title", "h1", "h2", "p", "caption", "th", "td") and not inside:
            self._text, self._classes = [], classes
        elif tag == "table" and not inside and self.sections:
            self.sections[-1].tables.append(DomTable())
        elif tag == "tr" and not inside:
            self._row = (classes, [])
        if tag not in ("meta", "br", "hr", "img", "input", "link"):
            self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._open:
            while self._open.pop() != tag:
                pass
        if self._text is not None and tag in ("title", "h1", "h2", "p", "caption", "th", "td"):
            text, self._text = " ".join("".join(self._text).split()), None
            sec = self.sections[-1] if self.sections else None
            if tag == "title":
                self.title = text
            elif tag == "h1":
                self.h1 = text
            elif tag == "h2" and sec is not None:
                sec.heading = text
            elif tag == "p" and sec is not None:
                sec.lines.append((text, self._classes))
            elif tag == "caption" and sec is not None:
                sec.tables[-1].caption = text
            elif tag in ("th", "td") and self._row is not None:
                self._row[1].append(Cell(text, self._classes))
        if tag == "tr" and self._row is not None and self.sections and self.sections[-1].tables:
            table = self.sections[-1].tables[-1]
            if "thead" in self._open:
                table.headers = self._row[1]
            else:
                table.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


def _parse(dom: str) -> _Dom:
    parser = _Dom()
    parser.feed(dom)
    parser.close()
    return parser


# -- tests -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report() -> ExplainReport:
    torch.manual_seed(0)
    rep = explain_with(Block(), (torch.randn(8, 16),), target="aten")
    assert rep.training and sorted(g.kind for g in rep.graphs) == ["backward", "forward"]
    assert all(g.target == "aten" and g.error is None for g in rep.graphs)
    return rep


@needs_browser
def test_browser_renders_every_section_and_table(report: ExplainReport, tmp_path: Path) -> None:
    path = report.to_html(tmp_path / "explain.html")
    run = _browser(tmp_path, "--dump-dom", url=path.as_uri())
    assert _script_errors(run.stderr) == []
    page = _parse(run.stdout)

    assert page.title == "Ember explain" and page.h1 == "Ember explain target aten, training"
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(page.tags)
    assert [s.heading for s in page.sections] == SECTIONS
    assert not any("alert" in s.classes for s in page.sections)  # no Problems section for a clean run

    # Every section the report produced, as the browser laid it out: same lines, same tables,
    # cell for cell, right-aligned from the numeric column on, totals marked.
    for want, got in zip(report.sections(), page.sections):
        assert got.heading == want.heading
        assert [text for text, _ in got.lines] == [" ".join(line.split()) for line in want.lines]
        assert [("sub" in cls) for _, cls in got.lines] == [line.startswith("  ") for line in want.lines]
        assert len(got.tables) == len(want.tables), want.heading
        for wt, gt in zip(want.tables, got.tables):
            assert gt.caption == wt.caption
            assert [c.text for c in gt.headers] == wt.headers
            assert [[c.text for c in cells] for _, cells in gt.rows] == wt.rows, want.heading
            for r, (row_classes, cells) in enumerate(gt.rows):
                assert ("total" in row_classes) == (wt.bold_last and r == len(wt.rows) - 1)
                assert [("num" in c.classes) for c in cells] == [i >= wt.numeric_from for i in range(len(cells))]

    by_heading = {s.heading: s for s in page.sections}

    # Compile time: every time is a number of milliseconds, one column per Ember stage.
    first, stages = by_heading["Compile time"].tables
    assert [c.text for c in first.rows[-1][1]][0].startswith("whole first call (forward + backward)")
    assert all(MS.match(cells[1].text) for _, cells in first.rows)
    assert [c.text for c in stages.headers] == ["graph", "target", *STAGES, "total"]
    assert len(stages.rows) == len(report.graphs) + 1
    ran = [2 + STAGES.index(s) for s in ("passes", "schedule", "codegen", "program")]
    for _, cells in stages.rows:
        # A stage that did not run (no cache lookup, no GPU kernel compile) shows "-".
        assert all(MS.match(c.text) or c.text == "-" for c in cells[2:]), [c.text for c in cells]
        compiled = all(MS.match(cells[i].text) for i in ran)
        cache_hit = MS.match(cells[2 + STAGES.index("cache_load")].text)  # an earlier explain stored it
        # or the frame cache held the whole frame: no Ember stage ran for it in this process
        framed = cells[0].text in {g.title for g in report.graphs if g.cache == "frame cache"}
        assert framed or ((compiled or cache_hit) and MS.match(cells[-1].text)), [c.text for c in cells]
    assert [cells[1].text for _, cells in stages.rows[:-1]] == ["aten", "aten"]

    # Ops by category: integer counts whose total row adds up, with the library ops (addmm, mm) there.
    (cats,) = by_heading["Ops by category"].tables
    names = [c.text for c in cats.headers]
    assert names[0] == "graph" and names[-1] == "all" and {"library", "pointwise", "reduction"} <= set(names)
    counts = [[int(c.text) for c in cells[1:]] for _, cells in cats.rows]
    assert all(INT.match(c.text) for _, cells in cats.rows for c in cells[1:])
    assert [sum(col) for col in zip(*counts[:-1])] == counts[-1]
    for row in counts[:-1]:
        assert sum(row[:-1]) == row[-1] > 0

    # Placement: one row per op, the GEMMs in the library column, LayerNorm/GELU math in fused-aten.
    (placed,) = by_heading["Placement"].tables
    cols = [c.text for c in placed.headers]
    rows = {cells[0].text: {cols[i]: c.text for i, c in enumerate(cells) if i and c.text} for _, cells in placed.rows}
    assert rows["aten.addmm"] == {"library": "1"} and rows["aten.mm"]["library"] == "1"
    assert {"aten.erf", "aten.rsqrt"} <= set(rows) and rows["aten.erf"].keys() == {"fused-aten"}
    assert all(INT.match(v) for op in rows.values() for v in op.values())
    total_ops = sum(int(v) for op in rows.values() for v in op.values())
    assert total_ops == counts[-1][-1]  # every op counted once in each table

    # Memory layout: the CPU target keeps eager's layout, said in words, no table.
    assert [t for t, _ in by_heading["Memory layout"].lines] == [report._layout_section().lines[0]]
    assert by_heading["Memory layout"].tables == []

    # Fallback ops: none on this model, said in words, no table.
    assert by_heading["Fallback ops"].lines == [("No op fell back to ATen.", {"line"})]
    assert by_heading["Fallback ops"].tables == []

    # Coverage: percentages adding up to 100 per row, and the compute-op count.
    (cov,) = by_heading["Coverage"].tables
    assert [c.text for c in cov.headers] == ["graph", *COMPUTE, "compute ops"]
    for _, cells in cov.rows:
        assert all(PCT.match(c.text) for c in cells[1:-1]) and INT.match(cells[-1].text)
        assert sum(float(c.text[:-1]) for c in cells[1:-1]) == pytest.approx(100.0, abs=0.2)
    total = [c.text for c in cov.rows[-1][1]]
    assert total[0] == "total" and float(total[COMPUTE.index("fused-aten") + 1][:-1]) > 50
    assert float(total[COMPUTE.index("library") + 1][:-1]) > 0

    # Graphs: one collapsible block per ATen graph, its non-ASCII dash intact (charset honoured).
    assert page.details == len(report.graphs) == 2
    dom = run.stdout
    for g in report.graphs:
        assert f"{g.title} — " in dom
    assert dom.count("<h4>Kernel plan</h4>") == 2 and dom.count("<h4>Generated program</h4>") == 2


@needs_browser
def test_browser_screenshot_shows_the_report(report: ExplainReport, tmp_path: Path) -> None:
    path = report.to_html(tmp_path / "explain.html")
    shot = tmp_path / "explain.png"
    run = _browser(tmp_path, f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars",
                   url=path.as_uri())
    assert _script_errors(run.stderr) == []
    assert shot.is_file() and shot.stat().st_size > 20_000, "screenshot missing or nearly empty"
    with Image.open(shot) as img:
        assert img.format == "PNG" and img.size == (WIDTH, HEIGHT)
        gray = img.convert("L")
        hist = gray.histogram()
        ink = sum(hist[:128])  # dark pixels: text and rules
        assert ink > 0.005 * WIDTH * HEIGHT, "almost nothing drawn"
        # The page is centred at most 1100 px wide: nothing (a table too wide, say) reaches the
        # right edge of a 1200 px window, and the top left holds the title's ink.
        right = gray.crop((WIDTH - 30, 0, WIDTH, HEIGHT))
        assert right.getextrema()[0] > 200, "content overflows to the right edge"
        assert gray.crop((0, 0, WIDTH // 2, 120)).getextrema()[0] < 100, "no title at the top"


@needs_browser
def test_console_errors_are_seen(tmp_path: Path) -> None:
    # The check above is only worth something if this Chromium logs a page's script errors to stderr.
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>notDefined();</script></body></html>")
    run = _browser(tmp_path, "--dump-dom", url=page.as_uri())
    errors = _script_errors(run.stderr)
    assert errors and any("notDefined" in e for e in errors)
