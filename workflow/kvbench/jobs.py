"""What every Snakemake script needs: its log, and provenance for the tables it writes."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any, Iterator, Mapping, TextIO


@contextlib.contextmanager
def job_log(path: str | os.PathLike, config: Mapping[str, Any]) -> Iterator[TextIO]:
    """Send prints and tracebacks to the rule's log (line-buffered, so progress is live).

    Also keeps the job off the hub when the config says so (every stage, every machine).
    """
    if config["hf_offline"]:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    with open(path, "w", buffering=1) as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            yield log
        except BaseException:
            traceback.print_exc(file=log)
            sys.__stderr__.write(f"kvbench: job failed, see {path}\n")
            raise
