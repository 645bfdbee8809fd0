"""lm-eval's simple_evaluate with the kvbench model on local tasks, offline, with the real model."""

from __future__ import annotations

import pandas as pd
import pytest
from quality_corpus import tiny_corpus

from kvbench.models import load_model
from kvbench.prompts import chat_ids
from kvbench.quality.engine import CONTEXT_ONLY, QUERY_AWARE
from kvbench.quality.run import evaluate
from kvbench.quality.taskfiles import build_tasks, load_sources, write_tasks

CFG = {"max_gen_cap": 6, "max_prompt_tokens": None, "lm_eval_tasks": []}
FULL16 = {"kind": "full", "storage": "fp16"}
KIVI2 = {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32}
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
    return evaluate(
        model,
        tokenizer,
        {"full": FULL16, "kivi2": KIVI2},
        tasks_dir,
        CFG,
        seed=3,
        protocols=(QUERY_AWARE, CONTEXT_ONLY),
        reference="full",
    )


def test_simple_evaluate_scores_every_sample_method_and_protocol_through_the_adapter(full):
    table, lm = full
    assert len(table) == 2 * 2 * 2  # samples x methods x protocols
    assert sorted(set(table.task)) == ["kvbench_few_shot", "kvbench_single_doc_qa"]
    assert table.error.isna().all(), table.error
    assert table.score.notna().all() and (table.new_tokens <= 6).all()
    assert (table.max_new_tokens == 6).all() and set(table.max_gen_tokens) == {64}  # LongBench's, capped
    for row in table.itertuples():  # the prompt as built (a few tokens of re-tokenizing a cut), not truncated again
        assert row.prompt_tokens <= TASKS[row.task.removeprefix("kvbench_")]["context_tokens"][0] + 8
    assert not table.truncated.any() and set(table.bucket) == {"0-4k"}
    assert (table[table.protocol == QUERY_AWARE].ratio_prefill[table.method == "full"] == 1.0).all()
    assert (table.ttft_s > 0).all() and (table.question_tokens > 0).all()
    # After decode, full holds its spare room too (1/64 of the tokens + 1: MethodLayer.append).
    full16 = table[table.method == "full"]
    assert ((full16.ratio_end <= 1.0) & (full16.ratio_end > 1 - 1 / 64 - 2 / full16.prompt_tokens)).all()
    # Chat template for QA, none for few-shot (as LongBench's pred.py).
    few_shot = table[table.task == "kvbench_few_shot"].iloc[0]
    assert few_shot.context_tokens == few_shot.prompt_tokens
    qa = table[table.task == "kvbench_single_doc_qa"].iloc[0]
    assert qa.context_tokens == qa.prompt_tokens + len(chat_ids(lm.tokenizer, ""))  # exactly the template's tokens
    assert set(lm.new_references) == {
        f"{p}/{t}/{s}" for p in (QUERY_AWARE, CONTEXT_ONLY) for t, s in zip(table.task, table.sample_id)
    }


def test_lm_eval_scores_the_first_method_as_the_table_does(full):
    # lm-eval scored the first method's answers under the first protocol; the table applies each task's
    # own process_results to every answer: for those, the two agree.
    table, lm = full
    first = table[(table.method == "full") & (table.protocol == QUERY_AWARE)]
    assert (
        first.prediction == [lm.answer("full", QUERY_AWARE, f"{t}/{s}") for t, s in zip(first.task, first.sample_id)]
    ).all()


def test_a_method_is_compared_with_the_references(full):
    table, lm = full
    kivi = table[table.method == "kivi2"]
    assert kivi.kl_mean.notna().all() and kivi.fidelity_note.isna().all()
    assert set(kivi.fidelity_reference) == {"whole vocabulary"}
    for row in kivi.itertuples():
        reference = lm.new_references[f"{row.protocol}/{row.task}/{row.sample_id}"]
        assert row.fidelity_positions == len(reference.tokens) - 1
    # query-aware: position 0 follows the uncompressed prefill, identical to full's; context-only: the method's
    assert (kivi[kivi.protocol == QUERY_AWARE].kl_first < 1e-5).all()
    assert (kivi[kivi.protocol == CONTEXT_ONLY].kl_first > 1e-5).all()


def test_a_sample_the_reference_failed_on_keeps_its_score_without_fidelity(model, tokenizer, tasks_dir, full):
    missing, *kept = full[1].new_references
    partial = {key: full[1].new_references[key] for key in kept}
    protocol = missing.split("/", 1)[0]
    table, lm = evaluate(
        model, tokenizer, {"full": {"kind": "full"}}, tasks_dir, CFG, seed=3, protocols=(protocol,), references=partial
    )
    assert table.error.isna().all() and table.score.notna().all() and len(table) == 2
    gap = table[[f"{protocol}/{t}/{s}" == missing for t, s in zip(table.task, table.sample_id)]].iloc[0]
    assert pd.isna(gap.kl_mean) and gap.fidelity_note.startswith("fidelity: no full-cache reference")
    other = table[table.index != gap.name].iloc[0]
    assert other.kl_mean == pytest.approx(0.0, abs=1e-6) and pd.isna(other.fidelity_note)


def test_a_failing_method_becomes_rows_with_its_error(model, tokenizer, tasks_dir):
    table, _ = evaluate(
        model,
        tokenizer,
        {"broken": {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}},
        tasks_dir,
        CFG,
        seed=3,
    )
    assert len(table) == 2 and table.score.isna().all()
    assert set(table.error) == {"ValueError: kivi: group_size 7 must divide head_dim 64"}


def test_fake_end_of_sequence_first_is_an_empty_output_row(model, tokenizer, tasks_dir, monkeypatch):
    # A fake generation (the first token is end-of-sequence): the row keeps its score and says so.
    from kvbench.quality import engine

    real = engine.run

    def eos_only(*args, **kwargs):
        outcomes, made = real(*args, **kwargs)
        for outcome in outcomes.values():
            outcome.tokens = [model.generation_config.eos_token_id]
        return outcomes, made

    monkeypatch.setattr(engine, "run", eos_only)
    table, _ = evaluate(model, tokenizer, {"full": {"kind": "full"}}, tasks_dir, CFG, seed=3)
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
    results = simple_evaluate(
        model="kvbench",
        model_args=f"model={model_dir},method=kivi4,config={config}",
        tasks=tasks,
        log_samples=True,
        bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
    )
    by_name = {t: [s["filtered_resps"][0] for s in results["samples"][t]] for t in tasks}
    assert all(0 <= results["results"][t]["score,none"] <= 100 for t in tasks)  # scored (NaN fails)
    # The pipeline's path on the same tasks: the same answers, so the same spec, cap, seed and chat rule
    # (the task manifest's flags there, the task names here: few-shot plain, QA with the chat template).
    table, _ = evaluate(model, tokenizer, {"kivi4": spec}, tasks_dir, CFG, seed=3)
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
    names = (
        "kvbench_few_shot",
        "kvbench_single_doc_qa",
        "longbench_trec",
        "longbench_hotpotqa_e",
        "kvbench_longbench_samsum",
        "kvbench_longbench_qasper",
    )
    assert [uses_chat(t) for t in names] == [False, True, False, True, False, True]
