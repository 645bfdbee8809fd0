from kvbench.corpus.factsheets import DocPlan
from kvbench.corpus.realistic import GeneratedDoc, Section, locate_facts


def make_doc(text: str, header_end: int, facts: dict[str, str]) -> GeneratedDoc:
    plan = DocPlan("medical-x-00", "medical", "discharge_summary", "Discharge Summary",
                   ("Course",), ("patient_name",), facts)
    return GeneratedDoc(plan, text, header_end, [Section("Course", header_end + 2, len(text), 10)], 0)


def test_kept_facts_are_located_exactly_and_missing_ones_dropped():
    header = "DISCHARGE SUMMARY\n\nPatient name: Ana Ruiz"
    body = "\n\nCOURSE\nAna Ruiz, 70, received Ceftriaxone 1 g IV daily. Born 1970."
    doc = make_doc(header + body, len(header), {
        "patient_name": "Ana Ruiz", "age": "70", "drug": "ceftriaxone", "dose": "1 g IV daily",
        "mrn": "1234567", "finding": "ejection fraction of 30%",
    })
    kept, dropped = locate_facts(doc)
    by_key = {k["fact"]: k for k in kept}
    assert set(dropped) == {"mrn", "finding"}
    for key, row in by_key.items():
        assert doc.text[row["char_start"]:row["char_end"]].lower() == doc.plan.facts[key].lower()
    # The model repeated the name in a section: located there, not in the header.
    assert by_key["patient_name"]["source"] == "generated"
    assert by_key["patient_name"]["section"] == "Course"
    assert by_key["patient_name"]["occurrences"] == 2
    # "70" is found as a word once, never inside "1970".
    assert by_key["age"]["occurrences"] == 1
    assert by_key["drug"]["question"] == "Which treatment did the patient receive?"


def test_header_only_fact_is_marked_header():
    header = "CASE\n\nPatient name: Bo Li"
    doc = make_doc(header + "\n\nCOURSE\nNo names here.", len(header), {"patient_name": "Bo Li"})
    kept, dropped = locate_facts(doc)
    assert dropped == []
    assert kept[0]["source"] == "header" and kept[0]["section"] == "header"
