"""Task builders on a tiny generated corpus: determinism, the presence check, LongBench's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvbench.corpus.factsheets import vocabulary

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


def located_in(context: str, doc: dict, fact: dict) -> bool:
    """Independent of the builders' check: the header line "Label: value", or the located mention
    with the words around it (its unit: "24 years"), or the value as a whole line (a title in
    capitals), appears verbatim (up to case) in the context."""
    label = vocabulary(doc["domain"])["facts"][fact["fact"]]["label"]
    window = doc["text"][max(0, fact["char_start"] - 12):fact["char_end"] + 12]
    lines = context.lower().splitlines()
    return (f"{label}: {fact['value']}".lower() in context.lower() or window.lower() in context.lower()
            or fact["value"].lower() in lines)


def test_answers_are_located_in_their_context(built, sources):
    docs = sources.docs.set_index("doc_id", drop=False)
    facts = sources.facts.set_index(["doc_id", "fact"], drop=False)
    for name in ("single_doc_qa", "multi_doc_qa"):
        for sample in built[f"kvbench_{name}"].samples:
            doc_id = next(d for d in sample["doc_ids"] if (d, sample["fact"]) in facts.index
                          and facts.loc[(d, sample["fact"])].value == sample["answers"][0])
            assert located_in(sample["context"], docs.loc[doc_id], facts.loc[(doc_id, sample["fact"])]), sample["_id"]
    for sample in built["kvbench_retrieval"].samples:
        number = int(sample["answers"][0].split()[1])
        assert f"Paragraph {number}: " in sample["context"] and sample["question"] in sample["context"]
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
    by_doc = docs.set_index("doc_id", drop=False)
    by_fact = sources.facts.set_index(["doc_id", "fact"], drop=False)
    for s in task.samples:
        assert located_in(s["context"], by_doc.loc[s["doc_ids"][0]], by_fact.loc[(s["doc_ids"][0], s["fact"])])
    assert len(task.samples) < len(sources.facts)


def age_document(filler_sentences: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A discharge summary whose only "24-year-old" sits in the middle, between a header date's
    "24" and a "24 hours" near the top: a middle cut removes the age and keeps the other 24s."""
    filler = " ".join(["The team reviewed the record in detail before the next step was taken."] * filler_sentences)
    text = ("DISCHARGE SUMMARY\n\nAdmission date: January 24, 2023\n\nHOSPITAL COURSE\nShe received fluids for "
            f"24 hours. {filler} The patient is a 24-year-old woman. {filler} She went home in good health.")
    at = text.index("24-year-old")
    docs = pd.DataFrame([{"doc_id": "medical-age-00", "corpus": "realistic", "domain": "medical",
                          "doc_type": "discharge_summary", "title": "Discharge summary", "text": text,
                          "sections": json.dumps([["Hospital course", text.index("HOSPITAL"), len(text)]]),
                          "fact_sheet": json.dumps({"age": "24"})}])
    facts = pd.DataFrame([{"doc_id": "medical-age-00", "fact": "age", "value": "24", "question": "How old is the patient?",
                           "char_start": at, "char_end": at + 2, "section": "Hospital course", "source": "generated",
                           "occurrences": 1, "unambiguous": True, "ambiguity": None}])
    return docs, facts


def test_an_answer_whose_located_span_is_cut_is_not_built_though_its_number_remains(tokenizer):
    docs, facts = age_document(filler_sentences=12)
    sources = load_sources(docs, facts, None, tokenizer)
    settings = {"single_doc_qa": {"samples": 1, "context_tokens": [160]}}
    (task,) = build_tasks(settings, sources, seed=5)
    assert task.samples == []
    # the cut context still holds "24 hours", but not the age: a whole-word match would have built it
    context = sources.trim(docs.text[0], 160 - 60)
    assert "24 hours" in context and "24-year-old" not in context
    # the same document with room for the age is built, and the age is there, verbatim
    (task,) = build_tasks({"single_doc_qa": {"samples": 1, "context_tokens": [1024]}}, sources, seed=5)
    assert len(task.samples) == 1 and "a 24-year-old woman" in task.samples[0]["context"]


def test_a_summary_reference_states_only_facts_whose_span_survives(tokenizer):
    docs, facts = age_document(filler_sentences=12)
    sources = load_sources(docs, facts, None, tokenizer)
    (short,) = build_tasks({"summarization": {"samples": 1, "context_tokens": [160]}}, sources, seed=5)
    (long,) = build_tasks({"summarization": {"samples": 1, "context_tokens": [1024]}}, sources, seed=5)
    assert "24 hours" in short.samples[0]["context"] and "The age is 24." not in short.samples[0]["answers"][0]
    assert long.samples[0]["answers"][0].endswith("The age is 24.")


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
    from kvbench.tinyrun import REPO

    with pytest.raises(SystemExit):
        main(["--method", "kivi9", "--tasks", "results/quality/tasks", "--config", str(REPO / "config" / "config.yaml")])
    assert "--method kivi9: not a key of methods" in capsys.readouterr().err
