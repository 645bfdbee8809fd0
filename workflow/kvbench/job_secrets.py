"""Per-job secrets for the servers a job starts. On a cluster node, loopback is shared by every
user's jobs: without them another user's process could query our vLLM or read and write KV chunks
that our connector then loads into the model. Secrets travel in environment variables (readable by
this user only, unlike command lines) and never reach logs or tables."""

from __future__ import annotations

import secrets

VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: guards /v1/* (not /health or /metrics)
VALKEY_PASSWORD_ENV = "KVBENCH_VALKEY_PASSWORD"  # read by our connector inside the vLLM server


def job_secret() -> str:
    return secrets.token_urlsafe(32)


def bearer(api_key: str | None) -> dict[str, str]:
    """The HTTP header that authenticates to a server started with `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
