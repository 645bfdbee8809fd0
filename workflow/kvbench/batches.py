"""Which methods run together in one job of the quality and system stages. Torch-free: the workflow
reads it while it parses.

A job is one process: its imports and model load (~9 s on 2 cores for a 135M model) are paid once
per job, not once per method, and methods timed in one process can be paired run by run."""

from __future__ import annotations

from typing import Sequence


def batches(methods: Sequence[str], reference: str, per_job: int | None) -> list[list[str]]:
    """Quality: the methods of each job, the reference first in the first job (it makes the references
    the other jobs read); `per_job` None: one job."""
    ordered = [reference] + [m for m in methods if m != reference]
    size = per_job or len(ordered)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def paired_batches(methods: Sequence[str], baseline: str, per_job: int | None) -> list[list[str]]:
    """System: the methods of each job, each job led by the baseline, so every method is timed next to
    a baseline in its own process (its paired ratios); `per_job` None: one job."""
    others = [m for m in methods if m != baseline]
    size = per_job or max(len(others), 1)
    return [[baseline, *others[i : i + size]] for i in range(0, len(others), size)] or [[baseline]]
