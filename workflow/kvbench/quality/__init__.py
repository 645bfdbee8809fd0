"""Stage `quality`: LongBench-style tasks through lm-eval with every KV method, and fidelity to
the full cache (teacher-forced next-token distributions)."""

import lm_eval.models  # noqa: F401,E402  (lm-eval's own models: its registry loads them only while it is empty)
from lm_eval.api.registry import model_registry

# `simple_evaluate(model="kvbench", ...)`: registered by name, loaded when first asked for (the
# workflow imports this package while it parses: no torch here).
model_registry.register("kvbench", target="kvbench.quality.adapter:KvbenchLM")
