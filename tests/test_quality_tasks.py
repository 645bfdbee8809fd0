"""Task builders on a tiny generated corpus: determinism, the presence check, LongBench's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvbench.quality.kinds import check_task, quality_problems
from kvbench.quality.longbench import spec as longbench_spec
from kvbench.quality.taskfiles import build_tasks, load_sources, read_manifest, write_tasks
from kvbench.quality.tasks.base import contains
from quality_corpus import tiny_corpus

TASKS = {
    "single_doc_qa": {"samples": 3, "context_tokens": [256]},
    "multi_doc_qa": {"samples": 2, "context_tokens": [512], "documents": 3},
    "few_shot": {"samples": 2, "context_tokens": [384]},
    "summarization": {"samples": 1, "context_tokens": [256]},
    "retrieval": {"samples": 2, "context_tokens": [384]},
}


@pytest.fixture(scope="module")
def sources(tokenizer):
    docs, facts = tiny_corpus()
    return load_sources(docs, facts, None, tokenizer)


@pytest.fixture(scope="module")
def built(sources):
    return {task.name: task for task in build_tasks(TASKS, sources, seed=5)}


def test_every_task_is_built_within_its_context(built, sources):
    assert set(built) == {f"kvbench_{name}" for name in TASKS}
    for name, cfg in TASKS.items():
        task = built[f"kvbench_{name}"]
        assert len(task.samples) == cfg["samples"], name
        for sample in task.samples:
            prompt = task.spec.template
            for key in ("context", "question", "paragraphs"):
                prompt = prompt.replace("{{" + key + "}}", str(sample.get(key, "")))
            assert sources.count(prompt) <= cfg["context_tokens"][0] + 8, name  # re-tokenizing a cut shifts a few


def test_answers_are_in_their_context(built):
    for name in ("single_doc_qa", "multi_doc_qa", "retrieval"):
        for sample in built[f"kvbench_{name}"].samples:
            assert all(contains(sample["context"], a) for a in sample["answers"]), (name, sample["answers"])
    for sample in built["kvbench_multi_doc_qa"].samples:  # the answer is in one passage only
        passages = sample["context"].split("\nPassage ")
        assert sum(contains(p, sample["answers"][0]) for p in passages) == 1
    for sample in built["kvbench_few_shot"].samples:
        assert f"Type: {sample['answers'][0]}" in sample["context"] and sample["answers"][0] in sample["all_classes"]
        assert "\n" not in sample["question"].split("\nType:")[0]  # one line per excerpt: first-line scoring works


def test_a_fact_missing_from_the_text_is_never_asked(tokenizer):
    docs, facts = tiny_corpus(drop="drug")
    assert "drug" not in set(facts.fact)  # the locator drops it ...
    # ... and even a stale facts table that still lists it builds no sample around it.
    stale = facts[facts.fact == "diagnosis"].assign(fact="drug", value="ceftriaxone-xr", question="Which drug?")
    sources = load_sources(docs, stale, None, tokenizer)
    (task,) = build_tasks({"single_doc_qa": {"samples": 2, "context_tokens": [256]}}, sources, seed=5)
    assert task.samples == [] and task.requested == 2


def test_an_answer_cut_by_the_context_budget_is_not_built(tokenizer):
    docs, facts = tiny_corpus()
    late = facts.sort_values("char_start").groupby("doc_id").tail(1)  # the last fact of each text
    sources = load_sources(docs, late[late.char_start > 900], None, tokenizer)
    (task,) = build_tasks({"single_doc_qa": {"samples": 12, "context_tokens": [96]}}, sources, seed=5)
    assert all(contains(s["context"], s["answers"][0]) for s in task.samples)
    assert len(task.samples) < len(sources.facts)


def test_task_files_are_byte_identical_under_the_same_seed(sources, tmp_path, monkeypatch):
    trees = []
    for run in ("a", "b", "c"):
        monkeypatch.chdir(tmp_path)
        (tmp_path / run).mkdir()
        monkeypatch.chdir(tmp_path / run)
        write_tasks(build_tasks(TASKS, sources, seed=5 if run != "c" else 6), "tasks")
        trees.append({p.name: p.read_bytes() for p in sorted(Path("tasks").iterdir())})
    assert trees[0] == trees[1]
    assert trees[0]["kvbench_few_shot.jsonl"] != trees[2]["kvbench_few_shot.jsonl"]  # the seed matters


def test_yaml_is_a_local_lm_eval_task(sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tasks(build_tasks(TASKS, sources, seed=5), "tasks")
    text = (tmp_path / "tasks" / "kvbench_few_shot.yaml").read_text()
    assert "process_results: !function 'kvbench_metrics.classification_first_line'" in text
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ld.construct_scalar(node))
    task = yaml.load(text, Loader=loader)
    assert task["dataset_path"] == "json"
    assert task["dataset_kwargs"] == {"data_files": {"test": "tasks/kvbench_few_shot.jsonl"}}
    assert task["generation_kwargs"]["until"] == ["\n"] and task["generation_kwargs"]["max_gen_toks"] == 64
    assert [t["task"] for t in read_manifest(tmp_path / "tasks")] == [f"kvbench_{n}" for n in TASKS]
    line = json.loads((tmp_path / "tasks" / "kvbench_single_doc_qa.jsonl").read_text().splitlines()[0])
    assert {"context", "question", "answers", "all_classes", "length", "_id"} <= set(line)


@pytest.mark.parametrize("ours, dataset", [("single_doc_qa", "multifieldqa_en"), ("multi_doc_qa", "hotpotqa")])
def test_verbatim_prompts_equal_lm_evals_longbench_ones(ours, dataset):
    from importlib import import_module

    assert import_module(f"kvbench.quality.tasks.{ours}").SPEC.template == longbench_spec(dataset).template


def test_imported_longbench_lines_become_one_task_per_dataset(tokenizer):
    import pandas as pd

    rows = pd.DataFrame([
        {"doc_id": "h1", "doc_type": "hotpotqa", "text": "Passage 1:\nParis is the capital of France.",
         "question": "What is the capital of France?", "answers": json.dumps(["Paris"]), "all_classes": None},
        {"doc_id": "h2", "doc_type": "hotpotqa", "text": "Passage 1:\nRome is in Italy.",
         "question": "What is the capital of Spain?", "answers": json.dumps(["Madrid"]), "all_classes": None},
        {"doc_id": "t1", "doc_type": "trec", "text": "Question: Who?\nType: Human being",
         "question": "Question: Where?\nType:", "answers": json.dumps(["Location"]),
         "all_classes": json.dumps(["Human being", "Location"])},
    ])
    docs, facts = tiny_corpus()
    sources = load_sources(docs, facts, rows, tokenizer)
    files = {t.name: t for t in build_tasks({"longbench": {"samples": 5, "context_tokens": [4096]}}, sources, seed=1)}
    assert [s["_id"] for s in files["kvbench_longbench_hotpotqa"].samples] == ["h1"]  # Madrid is not in its context
    trec = files["kvbench_longbench_trec"]
    assert trec.spec.chat is False and trec.spec.until == ("\n",) and trec.spec.metric == "classification_first_line"
    assert trec.samples[0]["all_classes"] == ["Human being", "Location"]


def test_config_checks_name_the_key():
    with pytest.raises(ValueError, match="unknown task 'summarisation'"):
        check_task("summarisation", {"samples": 1})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['documents'\] for task 'few_shot'"):
        check_task("few_shot", {"samples": 1, "context_tokens": [512], "documents": 3})
    config = {"models": {"m": {}}, "methods": {"full": {}}, "corpus": {"imported": {"path": None}},
              "quality": {"models": ["m"], "methods": ["full", "kivi9"], "reference": "full"}}
    assert quality_problems(config) == ["quality.methods: 'kivi9' is not a key of methods (['full'])"]
    config["quality"] |= {"methods": ["full"], "lm_eval_tasks": ["longbench_hotpotqa", "hellaswag"]}
    [problem] = quality_problems(config)
    assert problem.startswith("quality.lm_eval_tasks: 'hellaswag' is not one of lm-eval's English LongBench tasks")


def test_the_command_line_names_a_bad_method(capsys):
    from kvbench.quality.__main__ import main
    from workflow_helpers import REPO

    with pytest.raises(SystemExit):
        main(["--method", "kivi9", "--tasks", "results/quality/tasks", "--config", str(REPO / "config" / "config.yaml")])
    assert "--method 'kivi9' is not a key of methods" in capsys.readouterr().err
