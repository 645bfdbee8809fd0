"""No measured figure is typed by hand in the docs: they are quoted only through generated regions
(kvbench.report.blocks), which `make readme` renders from the tables and `make readme-check`
re-renders to catch a stale one. This module finds the figures typed outside them.

Which numbers are not measurements, and where they may stand:
- anywhere: inside generated regions, code (fenced blocks and `inline code`: settings, defaults,
  commands, constants, file names), HTML comments, link targets, and quotations (lines starting
  with `>`: the seeds' own figures), and digits that are part of a name (fp16, KIVI-2,
  Llama-3.1-8B, a 4K prompt);
- anywhere: a bound, a number right after `≤`, `≥`, `<` or `>` (budgets and limits: `≤ 10 min`);
- in the results documents (RESULTS_DOCUMENTS of kvbench.report.readme): nowhere else — their
  prose has no other number;
- in the other documents (design, configuration, how-tos): any number except a time, a speed or a
  ratio (`12 s`, `3 min`, `5 tok/s`, `1.2×`), the units measured figures come in.
"""

from __future__ import annotations

import re

GENERATED = re.compile(r"<!-- generated:(?P<name>[a-z0-9.-]+) -->(?P<body>.*?)<!-- end generated:(?P=name) -->", re.S)
# Not prose: each is blanked (newlines kept, so line numbers hold) before numbers are looked for.
NOT_PROSE = (
    GENERATED,
    re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M),  # fenced code
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"(`+)(?:(?!\1)(?!\n\n).)+?\1", re.S),  # inline code (within a paragraph)
    re.compile(r"\]\([^)\s]*\)"),  # link targets
    re.compile(r"<https?://[^>]*>"),
    re.compile(r"^[ \t]*>.*$", re.M),  # quotations
)
NUMBER = re.compile(r"(?<![\w.\-/#+@])\d+(?:[.,]\d+)*")
# A unit right after a number: what measured figures come in. A ratio's `×` or `x` is glued to its
# number ("1.2×"; "2 × 64" is a product); a time or speed may follow a space.
MEASURED_UNIT = re.compile(
    r"×|x(?!\w)|[ \u00a0]?(?:ms|s|sec|min|minutes?|seconds?|hours?|h|job-seconds|tok/s|"
    r"tokens/s|MB/s|GB/s)(?![\w/])"
)
BOUND = re.compile(r"[≤≥<>][ \u00a0]*$")


def _blank(text: str, pattern: re.Pattern) -> str:
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def prose(text: str) -> str:
    """The text with everything but prose blanked out (same length and lines)."""
    for pattern in NOT_PROSE:
        text = _blank(text, pattern)
    return text


def hand_typed(text: str, results: bool) -> list[tuple[int, str]]:
    """(line, figure) of each number typed in prose that may be a measurement (see the module doc)."""
    found = []
    body = prose(text)
    for match in NUMBER.finditer(body):
        after = body[match.end() :]
        unit = MEASURED_UNIT.match(after)
        if after[:1].isalpha() and not unit:
            continue  # part of a name or a size: 4K, 135M, 2nd
        if BOUND.search(body[max(0, match.start() - 3) : match.start()]) or (not results and not unit):
            continue
        line = body.count("\n", 0, match.start()) + 1
        found.append((line, match.group(0) + (unit.group(0) if unit else "")))
    return found
