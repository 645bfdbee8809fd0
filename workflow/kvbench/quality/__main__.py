"""Run one KV method over the quality tasks outside Snakemake (lm-eval's CLI cannot load the
kvbench model: it has no plugin discovery).

    python -m kvbench.quality --method kivi2 --tasks results/quality/tasks \\
        --references results/quality/smollm2-135m/reference.safetensors --out kivi2.parquet

Methods and settings come from the config (`methods:`, `quality:`). Without `--references` there
are no fidelity columns; `--save-references` stores this run's continuations and distributions as
the references for other methods (run it with the full cache).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import yaml

from kvbench.config import check_config

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", required=True, help="a key of `methods:` in the config")
    parser.add_argument("--tasks", required=True, help="task folder written by the quality_tasks rule")
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--model", help="a key of `models:` (default: the first of quality.models)")
    parser.add_argument("--references", help="the full cache's references (reference.safetensors)")
    parser.add_argument("--save-references", help="write this run's continuations as references")
    parser.add_argument("--out", help="output Parquet (default: quality-<method>.parquet)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)

    config = yaml.safe_load(Path(args.config).read_text())
    check_config(config, SCHEMA)  # fills the schema's defaults in
    if args.method not in config["methods"]:
        parser.error(f"--method {args.method!r} is not a key of methods ({', '.join(config['methods'])})")
    if config["hf_offline"]:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    from kvbench.quality.job import run_job

    run_job(config, config["quality"], args.model or config["quality"]["models"][0], args.method, args.tasks,
            args.out or f"quality-{args.method}.parquet", args.references, args.save_references, args.threads)


if __name__ == "__main__":
    main()
