rule serve_server:
    input:
        docs=expand("results/corpus/{corpus}/docs.parquet", corpus=config["serve"]["corpora"]),
        model=model_dir(config["serve"]["model"]),
    output:
        requests="results/serve/servers/{server}/requests.parquet",
        metrics="results/serve/servers/{server}/metrics.parquet",
        transfers="results/serve/servers/{server}/transfers.parquet",
    params:
        cfg=lambda wc: serve_run(wc.server),
        vllm=VLLM_RUN,  # with the runtime settings (port, timeouts) the script reads from the config
        methods=lambda wc: serve_methods(wc.server),
        seed=config["seed"],
        # vLLM imports our connector by its module path (kvbench.vllm_server.CONNECTOR_MODULE).
        code=library_code("serve_server.py", extra=(CONNECTOR_MODULE,)),
    # A vLLM server (and Valkey) on the whole machine: rounds of different backends share it.
    threads: MACHINE_THREADS
    resources:
        **device_resources("serve_server"),
    log:
        main="logs/serve/{server}.log",
        vllm="logs/serve/{server}.vllm.log",
        valkey="logs/serve/{server}.valkey.log",
    benchmark:
        "benchmarks/serve/{server}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/serve_server.py"


rule serve_summary:
    input:
        requests=serve_parts("requests"),
        metrics=serve_parts("metrics"),
        transfers=serve_parts("transfers"),
        kv="results/kv/compressibility.parquet",
    output:
        requests=report(
            "results/serve/requests.parquet",
            caption="../report/serve_tables.rst",
            category="Serving",
        ),
        offload=report(
            "results/serve/offload.parquet",
            caption="../report/serve_offload.rst",
            category="Serving",
        ),
        metrics=report(
            "results/serve/server_metrics.parquet",
            caption="../report/serve_tables.rst",
            category="Serving",
        ),
        transfers="results/serve/transfers.parquet",
        load=report(
            "results/serve/load.parquet",
            caption="../report/serve_load.rst",
            category="Serving",
        ),
        engine=report(
            "results/serve/engine.parquet",
            caption="../report/serve_engine.rst",
            category="Serving",
        ),
        recommendations=report(
            "results/serve/recommendations.parquet",
            caption="../report/serve_recommendations.rst",
            category="Serving",
        ),
        candidates="results/serve/candidates.parquet",
        ttft_figure=report(
            "results/serve/ttft_hit_miss.png",
            caption="../report/serve_ttft.rst",
            category="Serving",
        ),
        wire_figure=report(
            "results/serve/wire_bytes.png",
            caption="../report/serve_wire.rst",
            category="Serving",
        ),
        hit_path_figure=report(
            "results/serve/hit_path.png",
            caption="../report/serve_hit_path.rst",
            category="Serving",
        ),
    params:
        cfg=config["serve"],
        scenarios=config["report"]["scenarios"],
        seed=config["seed"],
        code=library_code("serve_summary.py"),
    log:
        "logs/serve/summary.log",
    benchmark:
        "benchmarks/serve/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/serve_summary.py"
