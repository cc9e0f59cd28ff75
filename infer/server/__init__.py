"""OpenAI-compatible HTTP server (`infer serve`): FastAPI routes over one AsyncLLM per model."""
