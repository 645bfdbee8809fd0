"""The tiny run: the real workflow (snakemake CLI of this venv) on a small config, as the tests and
the benchmarks run it. It lives in the library so that bench/ and tests/ share it and bench/ never
imports tests/ (tests load a bench script only to test that script; both import kvbench through
the editable install)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import yaml

# The checkout this library is installed from (`pip install -e .`: workflow/kvbench/ inside it).
REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
FAKE_SLURM = REPO / "tests" / "fake_slurm"
# The fake site's names (tests/fake_slurm: DEFAULT_CLUSTER) for the profile's placeholders, as a
# user edits them for theirs.
FAKE_SITE = {
    "your-account": "kvbench",
    "your-cpu-partition": "cpu",
    "your-gpu-partition": "gpu",
    "your-gpu-type": "a100",
}


def site_profile(workdir: Path, names: dict[str, str] = FAKE_SITE) -> Path:
    """workflow/profiles/slurm with its placeholders replaced by `names` (a copy in workdir)."""
    text = (REPO / "workflow" / "profiles" / "slurm" / "config.yaml").read_text()
    for placeholder, name in names.items():
        text = text.replace(f'"{placeholder}"', f'"{name}"')
    folder = workdir / ".site-profile"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(text)
    return folder


def slurm_args(workdir: Path) -> tuple[str, ...]:
    """The cluster command of docs/cluster.md with the site's edited profile, minus the config file;
    status polling made fast for the fake (the plugin waits 40 s before its first status check by
    default)."""
    return (
        "--workflow-profile",
        str(site_profile(workdir)),
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--seconds-between-status-checks",
        "1",
    )


def default_config() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))


def tiny_config(model_dir: Path, workdir: Path) -> dict[str, Any]:
    """The whole DAG in minutes: the real model (a local folder), 6 realistic documents of 160
    tokens, an imported folder (a note and a LongBench line), every method on 2 short prompts,
    the serve stage on one vLLM server and one Valkey, the quality
    tasks with four methods in two jobs and on vLLM's fp8 KV cache next to a 16-bit server."""
    imported = workdir / "my-docs"
    imported.mkdir(exist_ok=True)
    (imported / "note.txt").write_text("A short imported note about a patient with asthma.")
    (imported / "lb.jsonl").write_text(
        json.dumps({"context": "Contract text.", "input": "Who?", "answers": ["X"], "dataset": "qasper"}) + "\n"
    )
    config = default_config()
    config["models"] = {"smol": {"path": str(model_dir)}}
    config["corpus"].update(generator="smol", tokenizer="smol")
    config["corpus"]["synthetic"] = {"n_docs": 12, "words": 300}
    config["corpus"]["realistic"].update(
        docs_per_type=1, target_tokens=160, section_tokens=96, min_section_tokens=32, concurrency=6
    )
    config["corpus"]["imported"] = {"path": str(imported), "domain": "clinic"}
    config["kv"].update(
        model="smol",
        corpora=["synthetic", "realistic", "imported"],
        weights=["real", "dummy"],  # the blog's pair; random weights are the unit tests' (a job costs its imports)
        docs_per_corpus=2,
        context_tokens=160,
        chunk_tokens=64,
    )
    config["system"].update(
        models=["smol"],
        prompts_per_corpus={"realistic": 1, "synthetic": 1},
        context_tokens=[160],
        max_new_tokens=4,
        repeats=2,
    )
    # One vLLM server (recompute, prefix and valkey told apart per request) and one Valkey; lmcache
    # records its CPU "unsupported" row without a server; the fault round kills Valkey half-way.
    config["serve"].update(
        model="smol",
        backends=["recompute", "prefix", "valkey", "lmcache"],
        weights=["real"],
        codecs=["none", "zstd-3+byteplane", "kivi2"],
        docs_per_corpus=1,
        doc_tokens=288,
        block_size=128,
        repeat_count=2,
        hit_miss_ratio="1:1",
        max_tokens=4,
        fault_round=True,
        prewarm={"prompts": 1, "words": 50},
        # above the lowest level one codec; an open-loop level (Poisson arrivals) after the closed ones
        load={
            "corpora": ["realistic"],
            "concurrency": [1, 2],
            "rates": [8.0],
            "codecs": ["zstd-3+byteplane"],
            "hits_per_cell": 2,
        },
    )
    config["quality"].update(
        models=["smol"],
        methods=["full", "kivi2", "snapkv", "fp8"],  # fp8: the harness side of the engine's vllm-fp8
        methods_per_job=2,
        max_gen_cap=4,
        tasks={
            "single_doc_qa": {"samples": 1, "context_tokens": [192]},
            "multi_doc_qa": {"samples": 1, "context_tokens": [384], "documents": 2},
            "few_shot": {"samples": 1, "context_tokens": [256]},  # one document per type: no labelled example fits
            "summarization": {"samples": 1, "context_tokens": [192]},
            "retrieval": {"samples": 1, "context_tokens": [256], "paragraph_tokens": 64},
        },
        served={"servers": ["vllm-fp8"], "dtype": "bfloat16", "top_k": 20, "concurrency": 1},
    )
    # A scenario these tiny runs can meet (the default ones need quality at 1K tokens).
    config["report"]["scenarios"]["small-cache"] = {
        "limits": {"kv_bytes": {"max": 0.5, "relative": True}},
        "prefer": {"max": "decode_tok_s"},
    }
    return config


def write_config(workdir: Path, config: dict[str, Any], name: str = "config.yaml") -> Path:
    path = workdir / name
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(
    workdir: Path,
    config: dict[str, Any] | None,
    *args: str,
    timeout: int = 3600,
    slurm: bool = False,
    fake_slurm_nodes: int = 1,
) -> subprocess.CompletedProcess:
    """The snakemake CLI in `workdir`; `slurm=True` runs it through the SLURM executor plugin
    against the fake SLURM in tests/fake_slurm (its state in workdir/.fake_slurm) with
    `fake_slurm_nodes` nodes that split this machine's CPUs.

    On timeout snakemake gets SIGTERM first (it cancels its jobs, as on a real cluster), and any
    fake SLURM job still queued or running is cancelled: nothing outlives a test."""
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), *args]
    if config is not None:
        cmd += ["--configfile", str(write_config(workdir, config))]
    env = dict(os.environ)
    if slurm:
        cmd += slurm_args(workdir)
        env |= {
            "PATH": f"{FAKE_SLURM}{os.pathsep}{env['PATH']}",
            "FAKE_SLURM_DIR": str(workdir / ".fake_slurm"),
            "FAKE_SLURM_NODES": str(fake_slurm_nodes),
        }
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            if slurm:
                cancel_fake_slurm_jobs(workdir, env)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def cancel_fake_slurm_jobs(workdir: Path, env: dict[str, str]) -> None:
    jobs = [json.loads(p.read_text()) for p in (workdir / ".fake_slurm" / "jobs").glob("*.json")]
    active = [str(j["id"]) for j in jobs if j["state"] not in ("COMPLETED", "FAILED", "CANCELLED")]
    if active:
        subprocess.run([str(FAKE_SLURM / "scancel"), *active], env=env, check=False)


def checkout_python(code: Path, venv: Path) -> Path:
    """A Python that imports kvbench from the checkout `code` (its editable install: the one way
    kvbench is imported) and every other package from this venv, to run the workflow of another
    checkout (a commit under test) without a second full install. The new venv's site-packages
    name this venv's in a plain path line, so this venv's own kvbench install is not read."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    python = venv / "bin" / "python"
    overlay = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (overlay / "_kvbench_base.pth").write_text(f"{site}\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(code),
        ],
        check=True,
    )
    return python
