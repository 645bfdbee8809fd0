"""Stage `quality`: LongBench-style tasks through lm-eval with every KV method, and fidelity to
the full cache (teacher-forced next-token distributions)."""
