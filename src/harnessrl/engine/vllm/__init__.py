"""The vLLM engine: client, launched servers, installer, weight syncs, validation and the attach doctor."""
