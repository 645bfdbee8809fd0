import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from pathlib import Path

from kvbench.hub import link_prefetched
from kvbench.jobs import job_log
from kvbench.sources import package_file

with job_log(snakemake.log[0], snakemake.config):
    src, out = snakemake.params.source, Path(snakemake.output[0])
    if "gguf_package" in src:
        from kvbench.models import convert_gguf

        gguf = package_file(src["gguf_package"], src["gguf_file"])
        print(f"converting {gguf} -> {out} (fp32 safetensors)")
        convert_gguf(gguf, out)
    else:  # never downloads: `make prefetch` put the snapshot in the hub cache
        print(f"linking the prefetched {src['hub']} -> {out}")
        link_prefetched(snakemake.config, src["hub"], out)
