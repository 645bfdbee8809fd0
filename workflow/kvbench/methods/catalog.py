"""Importing this module registers every method (one module per method)."""

from kvbench.methods import cam, fp8, full, h2o, kivi, snapkv, streamingllm, turboquant  # noqa: F401
