"""Which methods run together in one quality job. Torch-free: the workflow reads it while it parses."""

from __future__ import annotations

from typing import Sequence


def batches(methods: Sequence[str], reference: str, per_job: int | None) -> list[list[str]]:
    """The methods of each job, the reference first in the first job; `per_job` None: one job.

    A job is one process: its imports and model load (~9 s on 2 cores for a 135M model, about a
    quarter of a method's run) are paid once per job, not once per method."""
    ordered = [reference] + [m for m in methods if m != reference]
    size = per_job or len(ordered)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]
