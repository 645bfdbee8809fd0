"""kvbench is imported one way: the editable install of the checkout that runs (`make setup` does
`pip install --no-deps -e .`; on a cluster, the same command in the job environment, or the conda
envs' post-deploy scripts). A workflow whose Python imports kvbench from another checkout would run
that checkout's code under these rules: it stops while it parses instead."""

from __future__ import annotations

import sys
from pathlib import Path

import kvbench


class CheckoutError(RuntimeError):
    """kvbench is installed from another checkout than the workflow's."""


def check_checkout(root: str | Path) -> None:
    """Raise unless the imported kvbench is `root`'s (the folder holding the Snakefile)."""
    imported = Path(kvbench.__file__).resolve().parent
    expected = (Path(root) / "workflow" / "kvbench").resolve()
    if imported != expected:
        raise CheckoutError(
            f"kvbench is imported from {imported}, not from this checkout ({expected}): install this checkout into "
            f"the Python that runs snakemake ({sys.executable}): `make setup`, or `pip install --no-deps -e {root}`"
        )
