"""Model preparation (GGUF shipped in a package -> fp32 safetensors folder) and weight variants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvbench.atomic import atomic_path
from kvbench.gpu_env import require_gpu_environment

WEIGHT_KINDS: tuple[str, ...] = ("real", "random", "dummy")
DUMMY_RANGE = 1e-3  # vLLM --load-format dummy: uniform(-1e-3, 1e-3)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 safetensors folder with its tokenizer.

    `save_pretrained` refuses a GGUF-loaded model, so the weights move into a model built
    from the (quantizer-free) config.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may appear as a missing lm_head; anything else is a conversion bug.
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def fp8_checkpoint(model_dir: str | Path) -> bool:
    """Whether the folder's config.json declares FP8 weights (quantization_config quant_method fp8)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    quant = json.loads(path.read_text()).get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == "fp8"


def load_model(
    model_dir: str | Path,
    weights: str = "real",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """Load a causal LM with real weights, or a deterministic `random` / `dummy` variant.

    random: the architecture's own HF initialisation under `seed`.
    dummy: every floating parameter uniform(-1e-3, 1e-3), each from a generator seeded with
    `seed`, exactly as vLLM's `--load-format dummy` does.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar line per tensor would swamp the job logs
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {WEIGHT_KINDS}, got {weights!r}")
    require_gpu_environment(device, fp8=fp8_checkpoint(model_dir))
    if weights == "real":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if weights == "dummy":
            with torch.no_grad():
                for param in model.state_dict().values():
                    if torch.is_floating_point(param):
                        gen = torch.Generator().manual_seed(seed)
                        param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
    return model.to(device).eval()


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
