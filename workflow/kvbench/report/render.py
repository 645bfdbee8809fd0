"""Tables as self-contained HTML pages (shown in the Snakemake report) and as Markdown (the docs)."""

from __future__ import annotations

import html
import math
from typing import Iterable

import pandas as pd

STYLE = """
body { font-family: system-ui, sans-serif; font-size: 13px; margin: 12px; color: #1f2933; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 22px; }
p.note { color: #52606d; max-width: 70em; }
table { border-collapse: collapse; margin: 6px 0 14px; }
th, td { border: 1px solid #cbd2d9; padding: 4px 7px; text-align: left; vertical-align: top; }
th { background: #f0f4f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.confirmed { background: #e3f9e5; } td.contradicted { background: #ffe3e3; }
td.not-measurable, td.not-run, td.none-qualifies { background: #f5f7fa; color: #616e7c; }
td.inconclusive, td.undecided { background: #fff8e1; color: #6b5900; }
"""


def fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def _css_class(value: object, numeric: bool) -> str:
    if numeric:
        return "num"
    text = str(value)
    if text.startswith("not measurable"):
        return "not-measurable"
    if text.startswith("undecided at n"):
        return "undecided"
    return {
        "confirmed": "confirmed",
        "contradicted": "contradicted",
        "inconclusive": "inconclusive",
        "not run": "not-run",
        "none qualifies": "none-qualifies",
    }.get(text, "")


def html_table(df: pd.DataFrame, table_id: str) -> str:
    numeric = {c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])}
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    for row in df.itertuples(index=False):
        cells = []
        for col, value in zip(df.columns, row):
            cls = _css_class(value, col in numeric)
            attr = f' class="{cls}"' if cls else ""
            cells.append(f"<td{attr}>{html.escape(fmt(value))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def html_page(title: str, sections: Iterable[tuple[str, str, pd.DataFrame | None]]) -> str:
    """A page of (heading, note, table) sections; a None table prints the note alone."""
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    for i, (heading, note, table) in enumerate(sections):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if note:
            parts.append(f'<p class="note">{html.escape(note)}</p>')
        if table is not None:
            parts.append(html_table(table, f"table-{i}"))
    parts.append("</body></html>")
    return "".join(parts)


def markdown_table(df: pd.DataFrame) -> str:
    def cell(value: object) -> str:
        return fmt(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
