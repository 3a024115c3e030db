"""The embedded engine's internals: continuous batching, prefill, prefix cache, sampling, stop strings."""
