"""The OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models)."""
