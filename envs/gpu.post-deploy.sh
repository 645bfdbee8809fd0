#!/usr/bin/env bash
# Run by snakemake --use-conda inside the new kvbench-gpu env. The library, the one way it is
# imported: an editable install of the checkout whose workflow created this env (common.smk
# exports KVBENCH_CHECKOUT while it parses).
set -euo pipefail
pip install --no-deps -e "${KVBENCH_CHECKOUT:?set by the workflow (common.smk) while it parses}"
