import pytest

from kvbench.corpus.factsheets import DocPlan
from kvbench.corpus.realistic import GeneratedDoc, Section, locate_facts, strip_chat_wrapping


def make_doc(text: str, header_end: int, facts: dict[str, str]) -> GeneratedDoc:
    plan = DocPlan(
        "medical-x-00", "medical", "discharge_summary", "Discharge Summary", ("Course",), ("patient_name",), facts
    )
    return GeneratedDoc(plan, text, header_end, [Section("Course", header_end + 2, len(text), 10)], 0)


def test_kept_facts_are_located_exactly_and_missing_ones_dropped():
    header = "DISCHARGE SUMMARY\n\nPatient name: Ana Ruiz"
    body = "\n\nCOURSE\nAna Ruiz, 70 years old, received Ceftriaxone 1 g IV daily. Born 1970."
    doc = make_doc(
        header + body,
        len(header),
        {
            "patient_name": "Ana Ruiz",
            "age": "70",
            "drug": "ceftriaxone",
            "dose": "1 g IV daily",
            "mrn": "1234567",
            "finding": "ejection fraction of 30%",
        },
    )
    kept, dropped = locate_facts(doc)
    by_key = {k["fact"]: k for k in kept}
    assert set(dropped) == {"mrn", "finding"}
    for key, row in by_key.items():
        assert doc.text[row["char_start"] : row["char_end"]].lower() == doc.plan.facts[key].lower()
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


def legal_doc(text: str, header_end: int, facts: dict[str, str]) -> GeneratedDoc:
    plan = DocPlan(
        "legal-deposition-00", "legal", "deposition", "Deposition Transcript", ("Events",), ("case_number",), facts
    )
    return GeneratedDoc(plan, text, header_end, [Section("Events", header_end + 2, len(text), 10)], 0)


def test_short_numbers_count_only_with_their_unit():
    header = "DISCHARGE SUMMARY\n\nAdmission date: January 24, 2023"
    body = "\n\nCOURSE\nShe received fluids for 24 hours. The 24-year-old woman improved."
    doc = make_doc(header + body, len(header), {"age": "24", "admission_date": "January 24, 2023"})
    kept, dropped = locate_facts(doc)
    age = next(k for k in kept if k["fact"] == "age")
    # Neither the header date nor "24 hours" is the age: only "24-year-old" is.
    assert age["occurrences"] == 1 and doc.text[age["char_start"] :].startswith("24-year-old")
    assert age["unambiguous"]
    only_hours = make_doc(header + "\n\nCOURSE\nFluids for 24 hours.", len(header), {"age": "24"})
    assert locate_facts(only_hours)[1] == ["age"]


def test_term_matches_its_unit_and_label_but_not_a_date():
    header = "AGREEMENT\n\nAgreement date: March 12, 2021"
    text = header + "\n\nEVENTS\nThe term is twelve (12) months; a 12-month renewal follows."
    plan = DocPlan(
        "legal-contract-00", "legal", "contract", "Agreement", ("Events",), ("effective_date",), {"term_months": "12"}
    )
    doc = GeneratedDoc(plan, text, len(header), [Section("Events", len(header) + 2, len(text), 10)], 0)
    (term,), _ = locate_facts(doc)
    assert term["occurrences"] == 2 and term["source"] == "generated"


def test_numbers_inside_longer_numbers_are_not_mentions():
    header = "DEPOSITION\n\nCase number: No. 1:20-cv-01234"
    doc = legal_doc(header + "\n\nEVENTS\nDamages of $12,500,000 were sought.", len(header), {"amount": "$12,500"})
    assert locate_facts(doc)[1] == ["amount"]


def test_a_name_inside_a_longer_name_is_ambiguous():
    header = "DEPOSITION\n\nCase number: No. 1:20-cv-01234"
    body = "\n\nEVENTS\nThe jury may award damages to Jackson Parrish-Ayala. Parrish-Ayala denied it."
    doc = legal_doc(header + body, len(header), {"party_b": "Parrish-Ayala", "case_number": "No. 1:20-cv-01234"})
    kept, _ = locate_facts(doc)
    by_key = {k["fact"]: k for k in kept}
    assert not by_key["party_b"]["unambiguous"]
    assert "Jackson Parrish-Ayala" in by_key["party_b"]["ambiguity"]
    assert by_key["case_number"]["unambiguous"]


def test_honorifics_and_articles_do_not_make_a_longer_name():
    header = "CASE\n\nAttending physician: Dr. Omar Haddad"
    body = "\n\nCOURSE\nDr. Omar Haddad saw the patient at The Riverside General Hospital daily."
    doc = make_doc(
        header + body, len(header), {"attending": "Dr. Omar Haddad", "hospital": "Riverside General Hospital"}
    )
    kept, _ = locate_facts(doc)
    assert all(k["unambiguous"] for k in kept), kept


def test_a_value_inside_another_facts_value_is_ambiguous():
    header = "NOTE\n\nAttending physician: Dr. Ana Ruiz"
    body = "\n\nCOURSE\nThe patient was seen by Dr. Ana Ruiz."
    doc = make_doc(header + body, len(header), {"patient_name": "Ana Ruiz", "attending": "Dr. Ana Ruiz"})
    by_key = {k["fact"]: k for k in locate_facts(doc)[0]}
    assert not by_key["patient_name"]["unambiguous"] and "attending" in by_key["patient_name"]["ambiguity"]
    assert by_key["attending"]["unambiguous"]


@pytest.mark.parametrize(
    "reply, body",
    [
        ("Sure, here is the section:\n\nThe patient improved.", "The patient improved."),
        ('Here\'s the "Plan" section of the note:\nContinue aspirin.', "Continue aspirin."),
        ("Certainly! I'd be happy to help.\nHere is the section:\n\nText one.\n\nI hope this helps!", "Text one."),
        ("The patient improved.\nLet me know if you need more details.", "The patient improved."),
        (
            "Surely the court erred. Here is why: the record is silent.",
            "Surely the court erred. Here is why: the record is silent.",
        ),
        ("**Here is the requested section:**\nText.", "Text."),
        ("Sure! The patient improved.", "The patient improved."),
        ("Certainly! I'd be happy to help. The wound was clean.", "The wound was clean."),
    ],
)
def test_chat_openers_and_sign_offs_are_stripped(reply, body):
    assert strip_chat_wrapping(reply) == body


@pytest.mark.parametrize(
    "reply, body",
    [
        # a paragraph that starts like an opener is document text (LLM paragraphs are single lines)
        (
            "Certainly, the defendant breached the contract on March 3, 2021, when Carter Group failed to pay $412,750."
            "\n\nThe court agreed.",
            "Certainly, the defendant breached the contract on March 3, 2021, when Carter Group failed to pay $412,750."
            "\n\nThe court agreed.",
        ),
        # an opener on the text's line: only the opener goes
        (
            "Sure, here is the section: The patient improved on ceftriaxone.\nShe went home.",
            "The patient improved on ceftriaxone.\nShe went home.",
        ),
        # discharge instructions are not a sign-off
        (
            "She went home.\nIf you have chest pain or fever above 101 F, return to the emergency department.",
            "She went home.\nIf you have chest pain or fever above 101 F, return to the emergency department.",
        ),
        (
            "She went home.\nIf you have any questions, call the clinic at 555-0100.",
            "She went home.\nIf you have any questions, call the clinic at 555-0100.",
        ),
        ("Here is why the motion fails: the record is silent.", "Here is why the motion fails: the record is silent."),
        ("I can confirm that the wound was clean.", "I can confirm that the wound was clean."),
        (
            "Here is a brief account of her course.\nShe improved.",
            "Here is a brief account of her course.\nShe improved.",
        ),
        (
            "Of course the plaintiff objected, and the objection was noted in the record before the hearing ended.",
            "Of course the plaintiff objected, and the objection was noted in the record before the hearing ended.",
        ),
        (
            "The plan is set.\nLet me know the results of the biopsy when they arrive, the attending wrote to the team "
            "on the evening of the third day after the surgery.",
            "The plan is set.\nLet me know the results of the biopsy when they arrive, the attending wrote to the team "
            "on the evening of the third day after the surgery.",
        ),
    ],
)
def test_document_text_that_looks_like_chat_wrapping_is_kept(reply, body):
    assert strip_chat_wrapping(reply) == body
