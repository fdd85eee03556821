"""Benchmarks for the serving stack and for any OpenAI-compatible server."""
