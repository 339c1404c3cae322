"""kvqrs as a vLLM KV-cache backend (see docs/vllm.md)."""
