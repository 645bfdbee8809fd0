"""Seeded fact sheets: the known answers each realistic document is written around.

Vocabularies live in kvbench/data/*.yaml; names, dates and places come from Faker, seeded.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import yaml
from faker import Faker

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@lru_cache(maxsize=None)
def vocabulary(domain: str) -> dict[str, Any]:
    path = DATA_DIR / f"{domain}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown domain {domain!r}: no vocabulary file {path}")
    return dict(yaml.safe_load(path.read_text()))


@dataclass(frozen=True)
class DocPlan:
    """Everything needed to write one document, fixed before any text is generated."""

    doc_id: str
    domain: str
    doc_type: str
    title: str
    sections: tuple[str, ...]
    header_keys: tuple[str, ...]
    facts: dict[str, str] = field(hash=False)
    seed: int = 0

    def prompt_facts(self) -> dict[str, str]:
        """Facts the model is asked to write (header facts are already in the text)."""
        return {k: v for k, v in self.facts.items() if k not in self.header_keys}


def _date(rng: random.Random, start_year: int = 2019, end_year: int = 2025) -> dt.date:
    start = dt.date(start_year, 1, 1)
    return start + dt.timedelta(days=rng.randrange((dt.date(end_year, 12, 31) - start).days))


def _fmt(day: dt.date) -> str:
    return f"{day:%B} {day.day}, {day.year}"


def medical_facts(rng: random.Random, fake: Faker, vocab: dict[str, Any]) -> dict[str, str]:
    cond = rng.choice(vocab["conditions"])
    sex = rng.choice(["male", "female"])
    admitted = _date(rng)
    return {
        "patient_name": fake.name_male() if sex == "male" else fake.name_female(),
        "age": str(rng.randint(24, 92)),
        "sex": sex,
        "mrn": str(rng.randint(10**6, 10**7 - 1)),
        "admission_date": _fmt(admitted),
        "discharge_date": _fmt(admitted + dt.timedelta(days=rng.randint(2, 12))),
        "attending": f"Dr. {fake.first_name()} {fake.last_name()}",
        "hospital": rng.choice(vocab["hospitals"]),
        "diagnosis": cond["diagnosis"],
        "drug": cond["drug"],
        "dose": cond["dose"],
        "test": cond["test"],
        "finding": cond["finding"],
        "symptom": rng.choice(vocab["symptoms"]),
        "comorbidity": rng.choice(vocab["comorbidities"]),
    }


def legal_facts(rng: random.Random, fake: Faker, vocab: dict[str, Any]) -> dict[str, str]:
    contract = rng.choice(vocab["contract_kinds"])
    case = rng.choice(vocab["case_kinds"])
    day = _date(rng)
    return {
        "party_a": fake.company(),
        "party_b": fake.company(),
        "effective_date": _fmt(day),
        "contract_kind": contract["kind"],
        "subject": contract["subject"],
        "amount": f"${rng.randrange(10_000, 5_000_000, 250):,}",
        "term_months": str(rng.choice([12, 18, 24, 36, 48, 60])),
        "governing_state": rng.choice(vocab["governing_states"]),
        "clause": rng.choice(vocab["clauses"]),
        "court": rng.choice(vocab["courts"]),
        "case_number": f"No. {rng.randint(1, 9)}:{rng.randint(19, 25)}-cv-{rng.randint(1000, 9999):05d}",
        "judge": f"Judge {fake.first_name()} {fake.last_name()}",
        "claim": case["claim"],
        "remedy": case["remedy"],
        "witness": fake.name(),
        "attorney": f"{fake.first_name()} {fake.last_name()}, Esq.",
        "deposition_date": _fmt(day + dt.timedelta(days=rng.randint(200, 700))),
        "city": fake.city(),
    }


FACT_MAKERS: dict[str, Callable[[random.Random, Faker, dict[str, Any]], dict[str, str]]] = {
    "medical": medical_facts,
    "legal": legal_facts,
}


def plan_documents(domains: list[str], docs_per_type: int, seed: int) -> list[DocPlan]:
    """One plan per domain x doc type x copy, each with its own seeded fact sheet."""
    plans = []
    for domain in domains:
        vocab = vocabulary(domain)
        for doc_type, spec in vocab["doc_types"].items():
            for copy in range(docs_per_type):
                doc_id = f"{domain}-{doc_type}-{copy:02d}"
                doc_seed = random.Random(f"{seed}/{doc_id}").randrange(2**31)
                rng = random.Random(doc_seed)
                fake = Faker("en_US")
                fake.seed_instance(doc_seed)
                sheet = FACT_MAKERS[domain](rng, fake, vocab)
                facts = {key: sheet[key] for key in spec["facts"]}
                title = spec["title"]
                if domain == "legal" and doc_type == "contract":
                    title = sheet["contract_kind"]
                plans.append(
                    DocPlan(
                        doc_id=doc_id,
                        domain=domain,
                        doc_type=doc_type,
                        title=title,
                        sections=tuple(spec["sections"]),
                        header_keys=tuple(spec["header"]),
                        facts=facts,
                        seed=doc_seed,
                    )
                )
    return plans
