"""`make run` sizes the default run for the CPU it runs on: config/avx2.yaml over the default where
the CPU does not serve bf16 (the serve stage's float32 fallback decides both)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvbench.serve.backends import served_dtype
from kvbench.sizing import cpu_serves_bf16, snakemake_args
from kvbench.tinyrun import REPO


def test_the_overlay_is_added_exactly_where_the_cpu_does_not_serve_bf16():
    assert snakemake_args(True) == []
    assert snakemake_args(False) == ["--configfile", "config/config.yaml", "config/avx2.yaml"]


@pytest.mark.parametrize("bf16", [True, False])
def test_the_serve_stage_falls_back_to_float32_by_the_same_check(monkeypatch, bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert cpu_serves_bf16() is bf16
    assert (served_dtype("bfloat16", "cpu")[0] == "bfloat16") is bf16


def test_make_run_passes_this_cpus_config_files_to_both_snakemake_commands():
    dry = subprocess.run(["make", "-n", "report"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    commands = [line for line in dry.stdout.splitlines() if "bin/snakemake" in line]
    assert len(commands) == 2, dry.stdout
    wanted = " ".join(snakemake_args(cpu_serves_bf16()))
    for command in commands:
        assert command.endswith(f" {wanted}") if wanted else "--configfile" not in command, command
