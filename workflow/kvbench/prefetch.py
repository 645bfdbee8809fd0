"""Download what a config reads from the hub into its `hub_cache` (on a node with internet).

    make prefetch CONFIG=config/gpu.yaml
    # = PYTHONPATH=workflow python -m kvbench.prefetch --configfile config/gpu.yaml
    make prefetch CONFIG="config/gpu.yaml my-site.yaml"   # overlays, as snakemake --configfile merges them

Hub models (`models.<name>.hub`, only the files that get loaded) and the datasets of
`quality.lm_eval_tasks`; a token for gated models comes from HF_TOKEN (or `hf auth login`).
Run it from the folder snakemake runs in: a relative `hub_cache` is relative to it.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvbench.checks import check_config
from kvbench.config import SCHEMA, load_configfiles
from kvbench.hub import PrefetchError, cache_root, hub_env, missing, prefetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.prefetch", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configfile", required=True, nargs="+", help="the config files the workflow will run with, in its order"
    )
    args = parser.parse_args(argv)
    config = load_configfiles(args.configfile)
    check_config(config, SCHEMA)  # fills the schema's defaults in (hub_cache, hf_offline)
    # Before huggingface_hub and datasets are imported: they read these once.
    os.environ.update(hub_env(config, offline=False))
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.pop(key, None)
    try:
        prefetch(config)
    except PrefetchError as err:
        print(f"kvbench prefetch: {err}", file=sys.stderr)
        return 1
    left = missing(config)
    if left:  # cannot happen unless the cache changed meanwhile; said rather than assumed
        print("kvbench prefetch: still missing:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    named = " + ".join(args.configfile)
    print(f"kvbench prefetch: everything {named} reads from the hub is in {cache_root(config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
