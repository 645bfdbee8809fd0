"""lm-eval's simple_evaluate with the kvbench model on local tasks, offline, with the real model."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.models import load_model
from kvbench.quality.run import evaluate_method
from kvbench.quality.taskfiles import build_tasks, load_sources, write_tasks
from quality_corpus import tiny_corpus

CFG = {"max_gen_cap": 6, "max_prompt_tokens": None, "lm_eval_tasks": []}
TASKS = {"single_doc_qa": {"samples": 1, "context_tokens": [192]}, "few_shot": {"samples": 1, "context_tokens": [256]}}


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tasks_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("quality") / "tasks"
    docs, facts = tiny_corpus()
    write_tasks(build_tasks(TASKS, load_sources(docs, facts, None, tokenizer), seed=3), folder)
    return folder


@pytest.fixture(scope="module")
def full(model, tokenizer, tasks_dir):
    return evaluate_method(model, tokenizer, "full", {"kind": "full", "storage": "fp16"}, tasks_dir, CFG, seed=3,
                           keep_references=True)


def test_simple_evaluate_scores_every_sample_through_the_adapter(full):
    table, lm = full
    assert sorted(table.task) == ["kvbench_few_shot", "kvbench_single_doc_qa"]
    assert table.error.isna().all(), table.error
    assert table.score.between(0, 1).all() and (table.new_tokens <= 6).all()
    assert (table.max_new_tokens == 6).all() and set(table.max_gen_tokens) == {64}  # LongBench's, capped
    assert (table.context_tokens <= 256 + 40).all() and not table.truncated.any() and set(table.bucket) == {"0-4k"}
    assert (table.ratio_end.round(6) == 1.0).all() and (table.ttft_s > 0).all()
    # Chat template for QA, none for few-shot (as LongBench's pred.py).
    few_shot = lm.records[f"kvbench_few_shot/{table[table.task == 'kvbench_few_shot'].lm_eval_doc_id.iloc[0]}"]
    assert few_shot["context_tokens"] == few_shot["prompt_tokens"]
    qa = table[table.task == "kvbench_single_doc_qa"].iloc[0]
    assert qa.context_tokens > qa.prompt_tokens
    assert set(lm.new_references) == {f"{t}/{d}" for t, d in zip(table.task, table.lm_eval_doc_id)}


def test_a_method_is_compared_with_the_references(model, tokenizer, tasks_dir, full):
    table, lm = evaluate_method(model, tokenizer, "kivi2", {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32},
                                tasks_dir, CFG, seed=3, references=full[1].new_references)
    assert table.kl_mean.notna().all() and (table.kl_mean >= 0).all()
    assert table.top1_agreement.between(0, 1).all() and (table.fidelity_positions >= 1).all()
    for row in table.itertuples():  # identical outputs exactly where no divergence was found
        same = list(row.output_ids) == full[1].new_references[f"{row.task}/{row.lm_eval_doc_id}"].tokens
        assert same == pd.isna(row.first_divergence)


def test_a_failing_method_becomes_rows_with_its_error(model, tokenizer, tasks_dir):
    table, _ = evaluate_method(model, tokenizer, "broken", {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}, tasks_dir,
                               CFG, seed=3)
    assert len(table) == 2 and table.score.isna().all()
    assert set(table.error) == {"ValueError: kivi: group_size 7 must divide head_dim 64"}


def test_a_missing_reference_is_an_error_row_not_a_silent_gap(model, tokenizer, tasks_dir, full):
    partial = dict(list(full[1].new_references.items())[1:])
    table, _ = evaluate_method(model, tokenizer, "full", {"kind": "full"}, tasks_dir, CFG, seed=3, references=partial)
    assert table.error.str.startswith("KeyError").sum() == 1 and len(table) == 2


def test_fake_end_of_sequence_first_is_an_empty_output_row(model, tokenizer, tasks_dir, monkeypatch):
    # A fake generation (the first token is end-of-sequence): the row keeps its score and says so.
    import kvbench.quality.adapter as adapter

    real = adapter.generate_scored

    def eos_only(model, spec, ids, max_new_tokens, **kwargs):
        result = real(model, spec, ids, 1, **kwargs)
        return result | {"tokens": [model.generation_config.eos_token_id]}

    monkeypatch.setattr(adapter, "generate_scored", eos_only)
    table, _ = evaluate_method(model, tokenizer, "full", {"kind": "full"}, tasks_dir, CFG, seed=3)
    assert (table.error == "empty output").all() and (table.score == 0).all() and (table.prediction == "").all()
