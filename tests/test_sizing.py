"""`make run` sizes the default run for the CPU it runs on: config/avx2.yaml over the default where
the CPU lacks AVX-512 BF16. No such CPU is at hand, so these tests fake the check's answer (a patched
torch check, or a stand-in for the venv's python): what they test is what make and the module do
with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.tinyrun import REPO

OVERLAY = "--configfile config/config.yaml config/avx2.yaml"


@pytest.mark.parametrize("bf16, printed", [(True, ""), (False, OVERLAY)])
def test_the_module_prints_the_overlay_exactly_where_a_faked_cpu_check_says_no_bf16(bf16, printed):
    run = (
        f"import torch; torch.cpu._is_avx512_bf16_supported = lambda: {bf16}; import runpy; "
        "runpy.run_module('kvbench.sizing', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == printed
    assert ("config/avx2.yaml" in done.stderr) is not bf16


def fake_bin(tmp_path: Path, sizing: str) -> tuple[Path, Path]:
    """A stand-in for .venv/bin: `python -m kvbench.sizing` runs `sizing`; `snakemake` logs its arguments."""
    bin_, log = tmp_path / "bin", tmp_path / "snakemake.log"
    bin_.mkdir()
    (bin_ / "python").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m kvbench.sizing" ] || exit 9\n{sizing}\n')
    (bin_ / "snakemake").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    for script in bin_.iterdir():
        script.chmod(0o755)
    return bin_, log


def make_report(bin_: Path, *extra: str) -> subprocess.CompletedProcess:
    """`make report` with the venv's setup taken as done (-o) and its bin replaced."""
    env = {k: v for k, v in os.environ.items() if k != "SIZING"}
    return subprocess.run(
        ["make", "-o", "setup", "report", f"BIN={bin_}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_make_run_on_a_faked_avx2_cpu_passes_the_overlay_to_both_snakemake_commands(tmp_path):
    bin_, log = fake_bin(tmp_path, f'echo "{OVERLAY}"')
    done = make_report(bin_)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [f"--cores all {OVERLAY}", f"--report results/report.html {OVERLAY}"]


def test_make_run_stops_before_snakemake_when_the_sizing_check_fails_fault(tmp_path):
    bin_, log = fake_bin(tmp_path, "echo 'no torch' >&2; exit 1")
    done = make_report(bin_)
    assert done.returncode != 0
    assert not log.exists()


def test_sizing_given_on_the_command_line_replaces_the_check(tmp_path):
    bin_, log = fake_bin(tmp_path, "exit 1")  # never consulted
    assert make_report(bin_, "SIZING=").returncode == 0
    assert make_report(bin_, "SIZING=--configfile my.yaml").returncode == 0
    assert log.read_text().splitlines() == [
        "--cores all",
        "--report results/report.html",
        "--cores all --configfile my.yaml",
        "--report results/report.html --configfile my.yaml",
    ]
