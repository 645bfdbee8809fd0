"""run_rows' benchmark hooks: `order` interleaves one-row steps as asked, `on_step` reports each
step, and neither changes what the rows decode."""

import random

import pytest
import torch

from kvbench.decode import Row, run_rows
from kvbench.fidelity import Reference
from kvbench.models import load_model, load_tokenizer
from kvbench.prefill import fork, shared_prefill

SPECS = {"full": {"kind": "full"}, "kivi2": {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}}
STEPS = 4


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def rows(model, model_dir, forced: list[int] | None = None) -> list[Row]:
    ids = load_tokenizer(model_dir)("The report was filed on Monday by the clerk of the court. " * 8).input_ids
    prefill = shared_prefill(model, ids)
    reference = Reference(forced, None, "") if forced is not None else None
    return [
        Row(
            fork(model, prefill, spec, len(ids))[0],
            prefill.logits,
            len(ids),
            STEPS + 1,
            reference=reference,
            branch_free=False,
            tag=name,
        )
        for name, spec in SPECS.items()
    ]


def test_order_interleaves_steps_and_on_step_reports_each_outside_its_rows(model, model_dir):
    (answer,) = run_rows(model, rows(model, model_dir)[:1])
    shuffled = [random.Random(step).sample(list(SPECS), len(SPECS)) for step in range(STEPS)]
    rank = {(step, name): (step, i) for step, names in enumerate(shuffled) for i, name in enumerate(names)}
    seen: list[tuple[int, str, float, float, int | None]] = []

    def on_step(batch: list[Row], seconds: float, cpu_seconds: float) -> None:
        (row,) = batch
        seen.append((row.position - row.start - 1, row.tag, seconds, cpu_seconds, row.top))

    forced = rows(model, model_dir, answer.tokens)
    run_rows(model, forced, max_batch=1, order=lambda row: rank[(row.position - row.start, row.tag)], on_step=on_step)
    assert [(step, name) for step, name, *_ in seen] == [(s, n) for s, names in enumerate(shuffled) for n in names]
    assert all(seconds > 0 and cpu_seconds >= 0 for *_, seconds, cpu_seconds, _ in seen)
    # The rows' own step shares are the reported seconds; `top` is the step's greedy pick.
    for row in forced:
        assert row._seconds == pytest.approx(sum(s for _, name, s, *_ in seen if name == row.tag))
        tops = [top for _, name, *_, top in seen if name == row.tag]
        assert tops[-1] == int(row.logits.argmax())
    full = forced[0]
    assert full.tokens == answer.tokens and all(full.top1)  # the hooks change nothing decoded


def test_the_hooks_change_nothing_a_row_decodes(model, model_dir):
    # One row per step both ways (a batched pass rounds differently), the second kivi2 first.
    plain = run_rows(model, rows(model, model_dir), max_batch=1)
    hooked = run_rows(
        model, rows(model, model_dir), max_batch=1, order=lambda row: row.tag != "kivi2", on_step=lambda *_: None
    )
    assert [r.tag for r in plain] == [r.tag for r in hooked]
    for a, b in zip(plain, hooked):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)
