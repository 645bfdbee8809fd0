"""kvbench: the library behind the Snakemake workflow (no Snakemake imports here)."""

__version__ = "0.1.0"
