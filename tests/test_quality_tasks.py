"""Task builders on a tiny generated corpus: determinism, the presence check, LongBench's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from quality_corpus import tiny_corpus

from kvbench.corpus.factsheets import vocabulary
from kvbench.quality.kinds import check_task, quality_problems
from kvbench.quality.longbench import spec as longbench_spec
from kvbench.quality.taskfiles import build_tasks, load_sources, read_manifest, write_tasks
from kvbench.quality.tasks import multi_doc_qa, single_doc_qa
from kvbench.quality.tasks.base import contains, listed_rival, second_answer

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
    window = doc["text"][max(0, fact["char_start"] - 12) : fact["char_end"] + 12]
    lines = context.lower().splitlines()
    return (
        f"{label}: {fact['value']}".lower() in context.lower()
        or window.lower() in context.lower()
        or fact["value"].lower() in lines
    )


def test_answers_are_located_in_their_context(built, sources):
    docs = sources.docs.set_index("doc_id", drop=False)
    facts = sources.facts.set_index(["doc_id", "fact"], drop=False)
    for name in ("single_doc_qa", "multi_doc_qa"):
        for sample in built[f"kvbench_{name}"].samples:
            doc_id = sample["doc_ids"][0]  # the answer's source first: what the report clusters samples by
            assert facts.loc[(doc_id, sample["fact"])].value == sample["answers"][0], sample["_id"]
            assert located_in(sample["context"], docs.loc[doc_id], facts.loc[(doc_id, sample["fact"])]), sample["_id"]
    for sample in built["kvbench_retrieval"].samples:
        number = int(sample["answers"][0].split()[1])
        assert f"Paragraph {number}: " in sample["context"] and sample["question"] in sample["context"]
        # the answered paragraph (a head of one of its document's sections) comes from doc_ids[0]
        answered = sample["context"].split(f"Paragraph {number}: ", 1)[1].split("\n\nParagraph ", 1)[0]
        assert " ".join(answered.split()) in " ".join(docs.loc[sample["doc_ids"][0]].text.split())
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
    text = (
        "DISCHARGE SUMMARY\n\nAdmission date: January 24, 2023\n\nHOSPITAL COURSE\nShe received fluids for "
        f"24 hours. {filler} The patient is a 24-year-old woman. {filler} She went home in good health."
    )
    at = text.index("24-year-old")
    docs = pd.DataFrame(
        [
            {
                "doc_id": "medical-age-00",
                "corpus": "realistic",
                "domain": "medical",
                "doc_type": "discharge_summary",
                "title": "Discharge summary",
                "text": text,
                "sections": json.dumps([["Hospital course", text.index("HOSPITAL"), len(text)]]),
                "fact_sheet": json.dumps({"age": "24"}),
            }
        ]
    )
    facts = pd.DataFrame(
        [
            {
                "doc_id": "medical-age-00",
                "fact": "age",
                "value": "24",
                "question": "How old is the patient?",
                "char_start": at,
                "char_end": at + 2,
                "section": "Hospital course",
                "source": "generated",
                "occurrences": 1,
                "unambiguous": True,
                "ambiguity": None,
            }
        ]
    )
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


def discharge_summary(
    body: str, facts: dict[str, str], doc_id: str = "medical-unique-00", attending: str = "Dr. William Oliver"
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A hand-made discharge summary whose `facts` are located at their first mention in the text."""
    text = f"DISCHARGE SUMMARY\n\nAttending physician: {attending}\n\nHISTORY\n{body}"
    questions = vocabulary("medical")["facts"]
    docs = pd.DataFrame(
        [
            {
                "doc_id": doc_id,
                "corpus": "realistic",
                "domain": "medical",
                "doc_type": "discharge_summary",
                "title": "Discharge summary",
                "text": text,
                "sections": json.dumps([["History", text.index("HISTORY"), len(text)]]),
                "fact_sheet": json.dumps({"attending": attending, **facts}),
            }
        ]
    )
    rows = [
        {
            "doc_id": doc_id,
            "fact": k,
            "value": v,
            "question": questions[k]["question"],
            "char_start": text.index(v),
            "char_end": text.index(v) + len(v),
            "section": "History",
            "source": "generated",
            "occurrences": 1,
            "unambiguous": True,
            "ambiguity": None,
        }
        for k, v in facts.items()
    ]
    return docs, pd.DataFrame(rows)


FILLER_12 = " ".join(["The team reviewed the record in detail before the next step was taken."] * 12)


def test_a_second_comorbidity_in_the_context_is_not_built_unless_the_cut_removes_it(tokenizer):
    assert second_answer("medical", "comorbidity", "hypertension", "a history of hypertension and obesity") == "obesity"
    body = f"She has a history of hypertension. {FILLER_12} Her chart also lists obesity. {FILLER_12} She went home."
    sources = load_sources(*discharge_summary(body, {"comorbidity": "hypertension"}), None, tokenizer)
    (whole,) = build_tasks({"single_doc_qa": {"samples": 1, "context_tokens": [1024]}}, sources, seed=5)
    assert whole.samples == [] and whole.requested == 1
    (cut,) = build_tasks({"single_doc_qa": {"samples": 1, "context_tokens": [160]}}, sources, seed=5)
    [sample] = cut.samples
    assert sample["answers"] == ["hypertension"] and "hypertension" in sample["context"]
    assert "obesity" not in sample["context"]


@pytest.mark.parametrize("second, built", [("", True), (" and obesity", False)])
def test_a_multi_doc_answer_passage_with_a_second_comorbidity_is_not_built(tokenizer, second, built):
    # the distractors' own comorbidities (hyperlipidemia) do not count: the anchor names the passage
    parts = [
        discharge_summary(
            f"She has a history of hypertension{second}. {FILLER_12}",
            {"attending": "Dr. William Oliver", "comorbidity": "hypertension"},
        )
    ]
    parts += [
        discharge_summary(f"He has hyperlipidemia. {FILLER_12}", {}, f"medical-other-{name}", f"Dr. Ann {name}")
        for name in ("Lee", "Park")
    ]
    docs, facts = (pd.concat(frames) for frames in zip(*parts))
    sources = load_sources(docs, facts, None, tokenizer)
    (task,) = build_tasks({"multi_doc_qa": {"samples": 1, "context_tokens": [1536], "documents": 3}}, sources, seed=5)
    assert len(task.samples) == int(built)
    if built:
        assert task.samples[0]["answers"] == ["hypertension"] and "hyperlipidemia" in task.samples[0]["context"]


@pytest.mark.parametrize(
    "other, built",
    [("Dr. Oliver signed the discharge order.", True), ("Dr. Emma Taylor, MD, read the chest film.", False)],
)
def test_another_doctor_in_the_context_makes_the_attending_ambiguous(tokenizer, other, built):
    body = f"She has a history of hypertension. {other} She went home."
    sources = load_sources(*discharge_summary(body, {"attending": "Dr. William Oliver"}), None, tokenizer)
    (task,) = build_tasks({"single_doc_qa": {"samples": 1, "context_tokens": [512]}}, sources, seed=5)
    assert len(task.samples) == int(built)


@pytest.mark.parametrize(
    "kind, answer, text, rival",
    [
        (
            "judge",
            "Judge Logan Smith",
            "Judge Smith wrote for the panel, joined by Justice Sonia Ortiz.",
            "Justice Sonia Ortiz",
        ),
        ("judge", "Judge Logan Smith", "JUDGE: Judge Logan Smith. Judge Smith denied the motion.", None),
        (
            "attorney",
            "Kevin Wong, Esq.",
            "Counsel Kevin Wong, Esq. for the plaintiff; Jane Roe, Esq. for the defendant.",
            "Jane Roe, Esq",
        ),
        ("attorney", "Kevin Wong, Esq.", "BY Kevin Wong, Esq.: Please state your name.", None),
        ("test", "arterial blood gas", "An arterial blood gas was drawn.", None),  # listed twice, for two conditions
        (
            "hospital",
            "Riverside General Hospital",
            "moved from riverside general hospital to MERCY VALLEY HOSPITAL",
            "Mercy Valley Hospital",
        ),
        ("admission_date", "May 1, 2023", "admitted May 1, 2023 and discharged May 9, 2023", None),  # a distinct role
    ],
)
def test_second_answers_of_roles_and_listed_kinds(kind, answer, text, rival):
    domain = "legal" if kind in ("judge", "attorney") else "medical"
    assert second_answer(domain, kind, answer, text) == rival


def test_a_value_inside_a_longer_listed_value_is_that_value():
    values = ["chronic kidney disease stage 3", "chronic kidney disease", "obesity"]
    text = "She has chronic kidney disease stage 3."
    assert listed_rival(text, "chronic kidney disease stage 3", values) is None
    assert listed_rival(text, "chronic kidney disease", values) == "chronic kidney disease stage 3"
    assert (
        listed_rival(text + " Chronic kidney disease runs in her family.", "chronic kidney disease stage 3", values)
        == "chronic kidney disease"
    )


def test_the_uniqueness_check_changes_only_the_samples_it_drops(tokenizer, tmp_path, monkeypatch):
    tiny_docs, tiny_facts = tiny_corpus()
    body = "She has a history of hypertension and obesity. She went home."
    rival_docs, rival_facts = discharge_summary(body, {"comorbidity": "hypertension"})
    corpora = {
        "tiny": (tiny_docs, tiny_facts),
        "mixed": (pd.concat([tiny_docs, rival_docs]), pd.concat([tiny_facts, rival_facts])),
    }
    settings = {**TASKS, "single_doc_qa": {"samples": len(tiny_docs) + 1, "context_tokens": [256]}}
    built = {}
    for checked in (True, False):
        if not checked:
            for builder in (single_doc_qa, multi_doc_qa):
                monkeypatch.setattr(builder, "second_answer", lambda *args: None)
        for name, (docs, facts) in corpora.items():
            (tmp_path / f"{name}-{checked}").mkdir()
            monkeypatch.chdir(tmp_path / f"{name}-{checked}")  # the YAML names its data file by this relative path
            write_tasks(build_tasks(settings, load_sources(docs, facts, None, tokenizer), seed=5), "tasks")
            built[name, checked] = {p.name: p.read_bytes() for p in sorted(Path("tasks").iterdir())}
    assert built["tiny", True] == built["tiny", False]  # no tiny-corpus context states a second value
    # with a second comorbidity in one document, only that document's sample goes (ids renumber after it)
    unchecked, checked = (
        [
            {k: v for k, v in json.loads(line).items() if k != "_id"}
            for line in built["mixed", c]["kvbench_single_doc_qa.jsonl"].decode().splitlines()
        ]
        for c in (False, True)
    )
    assert [s["doc_ids"] for s in unchecked if s not in checked] == [["medical-unique-00"]]
    assert len(checked) == len(tiny_docs) == len(unchecked) - 1


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

    rows = pd.DataFrame(
        [
            {
                "doc_id": "h1",
                "doc_type": "hotpotqa",
                "text": "Passage 1:\nParis is the capital of France.",
                "question": "What is the capital of France?",
                "answers": json.dumps(["Paris"]),
                "all_classes": None,
            },
            {
                "doc_id": "h2",
                "doc_type": "hotpotqa",
                "text": "Passage 1:\nRome is in Italy.",
                "question": "What is the capital of Spain?",
                "answers": json.dumps(["Madrid"]),
                "all_classes": None,
            },
            {
                "doc_id": "t1",
                "doc_type": "trec",
                "text": "Question: Who?\nType: Human being",
                "question": "Question: Where?\nType:",
                "answers": json.dumps(["Location"]),
                "all_classes": json.dumps(["Human being", "Location"]),
            },
        ]
    )
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
    config = {
        "models": {"m": {}},
        "methods": {"full": {}},
        "corpus": {"imported": {"path": None}},
        "quality": {"models": ["m"], "methods": ["full", "kivi9"], "reference": "full"},
    }
    assert quality_problems(config) == ["quality.methods: 'kivi9' is not a key of methods (['full'])"]
    config["quality"] |= {"methods": ["full"], "lm_eval_tasks": ["longbench_hotpotqa", "hellaswag"]}
    [problem] = quality_problems(config)
    assert problem.startswith("quality.lm_eval_tasks: 'hellaswag' is not one of lm-eval's English LongBench tasks")


def test_the_command_line_names_a_bad_method(capsys):
    from kvbench.quality.__main__ import main
    from kvbench.tinyrun import REPO

    with pytest.raises(SystemExit):
        main(
            ["--method", "kivi9", "--tasks", "results/quality/tasks", "--config", str(REPO / "config" / "config.yaml")]
        )
    assert "--method kivi9: not a key of methods" in capsys.readouterr().err
