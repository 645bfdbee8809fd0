"""Report captions are valid reStructuredText (snakemake --report renders them with docutils)."""

import io
import re
from pathlib import Path

import docutils.core
import pytest

CAPTIONS = sorted((Path(__file__).resolve().parents[1] / "workflow" / "report").glob("*.rst"))


@pytest.mark.parametrize("caption", CAPTIONS, ids=[c.name for c in CAPTIONS])
def test_caption_renders_without_warnings(caption):
    messages = io.StringIO()
    docutils.core.publish_doctree(
        caption.read_text(),
        source_path=str(caption),
        settings_overrides={"report_level": 2, "halt_level": 5, "warning_stream": messages},
    )
    assert messages.getvalue() == ""


def test_every_caption_is_used_by_a_rule():
    snakefile = CAPTIONS[0].parents[2] / "Snakefile"  # its `report:` page: workflow/report/workflow.rst
    rules = "".join(p.read_text() for p in [snakefile, *(CAPTIONS[0].parents[1] / "rules").glob("*.smk")])
    # report_page("x", ...) and report_figure("x", ...) (common.smk) caption with report_x.rst
    used = {f"report_{name}.rst" for name in re.findall(r'report_(?:page|figure)\("(\w+)"', rules)}
    assert [c.name for c in CAPTIONS if f"report/{c.name}" not in rules and c.name not in used] == []
