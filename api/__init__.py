"""The HTTP edge: OpenAI-compatible routes, admission, SSE from Redis, health."""
