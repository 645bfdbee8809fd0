import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.corpus.build import build_realistic
from kvbench.jobs import job_log
from kvbench.models import load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.vllm_server import runtime_settings

with job_log(snakemake.log.main, snakemake.config):
    params = snakemake.params
    tokenizer = load_tokenizer(snakemake.input.model)
    docs, facts = build_realistic(
        params.cfg,
        snakemake.input.model,
        {**params.vllm, **runtime_settings(snakemake.config)},
        params.seed,
        lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
        snakemake.log.vllm,
    )
    prov = provenance(snakemake.config, model=params.generator)
    write_table(facts, snakemake.output.facts, prov)
    write_table(docs, snakemake.output.docs, prov)
