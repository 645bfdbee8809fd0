# Reads the benchmark TSVs of every job before it (not declared as inputs: Snakemake does not
# track benchmark files as outputs); it runs after them because it needs their tables.
rule report_tables:
    input:
        unpack(report_inputs),
    output:
        methods="results/report/methods.parquet",
        corpora="results/report/corpora.parquet",
        correlations="results/report/correlations.parquet",
        claims="results/report/claims.parquet",
        recommendations="results/report/recommendations.parquet",
        stages="results/report/stages.parquet",
        differences="results/report/differences.parquet",
        system_ratios="results/report/system_ratios.parquet",
        power="results/report/power.parquet",
        costs="results/report/pipeline_cost.parquet",
        engine="results/report/engine.parquet",
        overview_html=report_page("overview", "Overview"),
        claims_html=report_page("claims", "Seed claims"),
        recommendations_html=report_page("recommendations", "Recommendation"),
        correlations_html=report_page("correlations", "Ratio vs end-to-end"),
        differences_html=report_page("differences", "Methods vs reference"),
        power_html=report_page("power", "Power"),
        engine_html=report_page("engine", "Engine quality"),
        costs_html=report_page("pipeline_cost", "Pipeline cost"),
        correlation_png=report_figure("correlation", "PNG"),
        correlation_svg=report_figure("correlation", "SVG"),
        tradeoff_png=report_figure("tradeoffs", "PNG"),
        tradeoff_svg=report_figure("tradeoffs", "SVG"),
        frontier_png=report_figure("frontier", "PNG"),
        frontier_svg=report_figure("frontier", "SVG"),
    params:
        cfg=config["report"],
        methods=config["methods"],
        harness={key: config["quality"][key] for key in ("compute_dtype", "reference_top_k", "fidelity_positions")},
        seed=config["seed"],
        benchmarks=benchmark_patterns,
        code=library_code("report_tables.py"),
    log:
        "logs/report/tables.log",
    benchmark:
        "benchmarks/report/tables.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/report_tables.py"
