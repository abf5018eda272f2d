"""Self-contained HTML for an explain report: inline CSS, no scripts, no external assets.

The sections come from ``ember.report.explain`` already as plain data (headings, lines,
tables), so the text and the HTML report always say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from ember.report.records import GraphRecord


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    caption: str = ""
    numeric_from: int = 1  # columns from this index on are right-aligned
    bold_last: bool = False  # the last row is a total


@dataclass
class Section:
    heading: str
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    alert: bool = False  # problems the reader must see first


_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1f23;
       max-width: 1100px; margin: 2em auto; padding: 0 1.2em; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
h1 small { font-weight: normal; color: #666; font-size: .6em; }
h2 { font-size: 1.2em; margin-top: 1.8em; padding-bottom: .25em; border-bottom: 2px solid #e6e8eb; }
h4 { margin: 1em 0 .3em; font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .95em; }
section.alert { border: 2px solid #c62828; background: #fdecea; border-radius: 6px; padding: 0 1em .8em; }
section.alert h2 { color: #b71c1c; border-color: #f5c2c0; }
p.line { margin: .25em 0; }
p.sub { margin-left: 1.6em; color: #444; }
table { border-collapse: collapse; margin: .6em 0 1em; font-size: .92em; }
caption { text-align: left; font-weight: 600; padding: .3em 0; }
th, td { padding: .28em .75em; border-bottom: 1px solid #e6e8eb; text-align: left; vertical-align: top; }
th { background: #f5f6f8; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: 600; border-top: 2px solid #c9ccd1; }
details { border: 1px solid #e0e2e6; border-radius: 6px; margin: .6em 0; padding: .3em .8em; }
details > summary { cursor: pointer; font-weight: 600; padding: .2em 0; }
details[open] > summary { border-bottom: 1px solid #e0e2e6; margin-bottom: .4em; }
pre { background: #f6f8fa; border: 1px solid #e6e8eb; border-radius: 4px; padding: .7em; overflow-x: auto;
      font: 12.5px/1.4 ui-monospace, Menlo, Consolas, monospace; }
.error { color: #b71c1c; font-weight: 600; }
.muted { color: #666; }
"""


def _table(t: Table) -> str:
    out = ["<table>"]
    if t.caption:
        out.append(f"<caption>{escape(t.caption)}</caption>")
    heads = "".join(f'<th{_num(i, t)}>{escape(h)}</th>' for i, h in enumerate(t.headers))
    out.append(f"<thead><tr>{heads}</tr></thead><tbody>")
    for r, row in enumerate(t.rows):
        cls = ' class="total"' if t.bold_last and r == len(t.rows) - 1 else ""
        cells = "".join(f"<td{_num(i, t)}>{escape(c)}</td>" for i, c in enumerate(row))
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _num(i: int, t: Table) -> str:
    return ' class="num"' if i >= t.numeric_from else ""


def _section(s: Section) -> str:
    cls = ' class="alert"' if s.alert else ""
    body = [f"<section{cls}><h2>{escape(s.heading)}</h2>"]
    # Lines indented in the text report (e.g. each graph-break reason) are indented here too.
    body += [f'<p class="line{" sub" if line.startswith("  ") else ""}">{escape(line.strip())}</p>'
             for line in s.lines]
    body += [_table(t) for t in s.tables]
    body.append("</section>")
    return "\n".join(body)


def _graph_details(g: GraphRecord) -> str:
    status = f'<span class="error">not compiled: {escape(g.error)}</span>' if g.error else \
        f'<span class="muted">target {escape(g.target)}, {g.kernels} generated kernel(s)</span>'
    parts = [f"<details><summary>{escape(g.title)} — {status}</summary>"]
    if g.input_signature:
        parts.append(f"<p class=\"muted\">inputs: {escape(', '.join(g.input_signature))}</p>")
    if g.passes:
        rows = [[name, f"{secs * 1e3:.2f}", str(changed)] for name, secs, changed in g.passes]
        parts.append(_table(Table(["pass", "ms", "changed"], rows, caption="Passes")))
    parts.append("<h4>Kernel plan</h4>")
    parts.append(f"<pre>{escape(g.plan_text or '(no plan)')}</pre>")
    parts.append("<h4>Generated program</h4>")
    parts.append(f"<pre>{escape(g.program or '(no program)')}</pre>")
    for name, src in g.kernel_sources.items():
        parts.append(f"<h4>Kernel {escape(name)}</h4>")
        parts.append(f"<pre>{escape(src)}</pre>")
    parts.append("</details>")
    return "\n".join(parts)


def render_html(title: str, subtitle: str, sections: list[Section], graphs: list[GraphRecord]) -> str:
    """One HTML page: the report sections, then one collapsible block per compiled graph."""
    body = [f"<h1>{escape(title)} <small>{escape(subtitle)}</small></h1>"]
    body += [_section(s) for s in sections]
    body.append("<section><h2>Graphs</h2>")
    body.append('<p class="line muted">Kernel plan, generated program and kernel sources of each graph.</p>')
    body += [_graph_details(g) for g in graphs]
    if not graphs:
        body.append('<p class="line">No graph was compiled.</p>')
    body.append("</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
