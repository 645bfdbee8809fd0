"""Stage `serve`: long-document serving on a real vLLM server, with KV offload to Valkey."""
