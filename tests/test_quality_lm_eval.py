"""lm-eval's simple_evaluate with the kvbench model on local tasks, offline, with the real model."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.models import load_model
from kvbench.prompts import chat_ids
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
    assert table.score.notna().all() and (table.new_tokens <= 6).all()
    assert (table.max_new_tokens == 6).all() and set(table.max_gen_tokens) == {64}  # LongBench's, capped
    for row in table.itertuples():  # the prompt as built (a few tokens of re-tokenizing a cut), not truncated again
        assert row.prompt_tokens <= TASKS[row.task.removeprefix("kvbench_")]["context_tokens"][0] + 8
    assert not table.truncated.any() and set(table.bucket) == {"0-4k"}
    assert (table.ratio_prefill == 1.0).all() and (table.ttft_s > 0).all()
    # After decode, full holds its spare room too (1/64 of the tokens + 1: MethodLayer.append).
    assert ((table.ratio_end <= 1.0) & (table.ratio_end > 1 - 1 / 64 - 2 / table.prompt_tokens)).all()
    # Chat template for QA, none for few-shot (as LongBench's pred.py).
    few_shot = lm.records[f"kvbench_few_shot/{table[table.task == 'kvbench_few_shot'].lm_eval_doc_id.iloc[0]}"]
    assert few_shot["context_tokens"] == few_shot["prompt_tokens"]
    qa = table[table.task == "kvbench_single_doc_qa"].iloc[0]
    assert qa.context_tokens == qa.prompt_tokens + len(chat_ids(lm.tokenizer, ""))  # exactly the template's tokens
    assert set(lm.new_references) == {f"{t}/{d}" for t, d in zip(table.task, table.lm_eval_doc_id)}


def test_a_method_is_compared_with_the_references(model, tokenizer, tasks_dir, full):
    table, lm = evaluate_method(model, tokenizer, "kivi2", {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32},
                                tasks_dir, CFG, seed=3, references=full[1].new_references)
    assert table.kl_mean.notna().all() and table.fidelity_note.isna().all()
    for row in table.itertuples():
        reference = full[1].new_references[f"{row.task}/{row.lm_eval_doc_id}"]
        # position 0 follows the uncompressed prefill: identical to full's, and kept out of kl_mean
        assert row.kl_first < 1e-5 and row.fidelity_positions == len(reference.tokens) - 1


def test_a_sample_the_reference_failed_on_keeps_its_score_without_fidelity(model, tokenizer, tasks_dir, full):
    missing, *kept = full[1].new_references
    partial = {key: full[1].new_references[key] for key in kept}
    table, lm = evaluate_method(model, tokenizer, "full", {"kind": "full"}, tasks_dir, CFG, seed=3, references=partial)
    assert table.error.isna().all() and table.score.notna().all() and len(table) == 2
    gap = table[[f"{t}/{d}" == missing for t, d in zip(table.task, table.lm_eval_doc_id)]].iloc[0]
    assert pd.isna(gap.kl_mean) and gap.fidelity_note.startswith("fidelity: no full-cache reference")
    assert gap.prediction == full[0].set_index("task").loc[gap.task, "prediction"]  # generated all the same
    other = table[table.index != gap.name].iloc[0]
    assert other.kl_mean == pytest.approx(0.0, abs=1e-6) and pd.isna(other.fidelity_note)


def test_one_excluded_warm_up_precedes_the_first_timed_request(model, tokenizer, tasks_dir, monkeypatch):
    import kvbench.quality.adapter as adapter

    calls, real = [], adapter.generate_scored

    def counted(model, spec, ids, max_new_tokens, **kwargs):
        calls.append((len(ids), max_new_tokens))
        return real(model, spec, ids, max_new_tokens, **kwargs)

    monkeypatch.setattr(adapter, "generate_scored", counted)
    table, lm = evaluate_method(model, tokenizer, "full", {"kind": "full"}, tasks_dir, CFG, seed=3)
    assert len(calls) == len(table) + 1 and calls[0][1] == 2 and calls[0][0] == min(256, calls[1][0])
    assert sorted(n for n, _ in calls[1:]) == sorted(table.context_tokens)  # the timed ones are the samples


def test_a_failing_method_becomes_rows_with_its_error(model, tokenizer, tasks_dir):
    table, _ = evaluate_method(model, tokenizer, "broken", {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}, tasks_dir,
                               CFG, seed=3)
    assert len(table) == 2 and table.score.isna().all()
    assert set(table.error) == {"ValueError: kivi: group_size 7 must divide head_dim 64"}


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


def test_simple_evaluate_runs_kvbench_by_name_as_the_pipeline_does(model, tokenizer, model_dir, tasks_dir, tmp_path):
    import yaml
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvbench.quality  # noqa: F401  (registers the name "kvbench")

    spec = {"kind": "kivi", "bits": 4, "group_size": 32, "residual": 32}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"seed": 3, "methods": {"kivi4": spec}, "quality": {"max_gen_cap": 6}}))
    tasks = ["kvbench_few_shot", "kvbench_single_doc_qa"]
    results = simple_evaluate(model="kvbench", model_args=f"model={model_dir},method=kivi4,config={config}",
                              tasks=tasks, log_samples=True, bootstrap_iters=0,
                              task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    by_name = {t: [s["filtered_resps"][0] for s in results["samples"][t]] for t in tasks}
    assert all(results["results"][t]["score,none"] == results["results"][t]["score,none"] for t in tasks)  # scored
    # The pipeline's path on the same tasks: the same answers, so the same spec, cap, seed and chat rule
    # (the task manifest's flags there, the task names here: few-shot plain, QA with the chat template).
    table, _ = evaluate_method(model, tokenizer, "kivi4", spec, tasks_dir, CFG, seed=3)
    assert by_name == {t: list(table[table.task == t].sort_values("lm_eval_doc_id").prediction) for t in tasks}


def test_by_name_specs_come_from_the_config_or_inline_and_bad_ones_name_the_problem():
    from kvbench.quality.adapter import method_spec, uses_chat

    config = {"methods": {"kivi4": {"kind": "kivi", "bits": 4}}}
    assert method_spec("kivi4", config, {"residual": 64}) == {"kind": "kivi", "bits": 4, "residual": 64}
    assert method_spec("mine", None, {"kind": "snapkv", "keep_ratio": 0.1}) == {"kind": "snapkv", "keep_ratio": 0.1}
    with pytest.raises(ValueError, match=r"method 'kivi2' is not in the config's methods \(the config's: kivi4\)"):
        method_spec("kivi2", config, {})
    with pytest.raises(ValueError, match=r"bits"):
        method_spec("kivi4", config, {"bits": 3})
    names = ("kvbench_few_shot", "kvbench_single_doc_qa", "longbench_trec", "longbench_hotpotqa_e",
             "kvbench_longbench_samsum", "kvbench_longbench_qasper")
    assert [uses_chat(t) for t in names] == [False, True, False, True, False, True]
