"""Reading a request: how vLLM would read it, which dialect it speaks, and the Plan it makes (pure, no ASGI)."""
