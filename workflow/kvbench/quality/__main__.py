"""Run KV methods over the quality tasks outside Snakemake (lm-eval's CLI cannot load the
kvbench model: it has no plugin discovery).

    python -m kvbench.quality --method kivi2 snapkv --tasks results/quality/smollm2-135m/tasks \\
        --references results/quality/smollm2-135m/reference.safetensors --out mine.parquet

Methods and settings come from the config (`methods:`, `quality:`); the methods run in this
process, every one forked from one shared prefill per sample, into one table. Without `--references` there are no fidelity columns;
`--save-references` stores the first method's continuations and distributions as the references
(run it with the full cache first) and compares the methods after it with them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from kvbench.checks import check_config
from kvbench.config import SCHEMA
from kvbench.hub import hub_env, require_prefetched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", required=True, nargs="+", help="keys of `methods:` in the config")
    parser.add_argument("--tasks", required=True, help="task folder written by the quality_tasks rule")
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--model", help="a key of `models:` (default: the first of quality.models)")
    parser.add_argument("--references", help="the full cache's references (reference.safetensors)")
    parser.add_argument("--save-references", help="write this run's continuations as references")
    parser.add_argument("--out", help="output Parquet (default: quality-<methods>.parquet)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)

    config = yaml.safe_load(Path(args.config).read_text())
    check_config(config, SCHEMA)  # fills the schema's defaults in
    unknown = [m for m in args.method if m not in config["methods"]]
    if unknown:
        parser.error(f"--method {', '.join(unknown)}: not a key of methods ({', '.join(config['methods'])})")
    if args.save_references and args.method[0] != config["quality"]["reference"]:
        parser.error(
            f"--save-references stores the first --method's continuations: put the reference "
            f"({config['quality']['reference']}) first"
        )
    os.environ.update(hub_env(config))  # before lm-eval and datasets are imported: they read it once
    require_prefetched(config, [args.config])
    from kvbench.config import model_dir
    from kvbench.provenance import provenance
    from kvbench.quality.job import run_job

    model = args.model or config["quality"]["models"][0]
    run_job(
        model_dir(config, model),
        {m: config["methods"][m] for m in args.method},
        config["quality"],
        int(config["seed"]),
        args.tasks,
        args.out or f"quality-{'-'.join(args.method)}.parquet",
        provenance(config, model=model),
        reference=args.method[0] if args.save_references else None,
        references_in=args.references,
        references_out=args.save_references,
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
