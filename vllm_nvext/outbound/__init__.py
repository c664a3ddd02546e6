"""Reshaping an answer: unary bodies and streamed events, driven by the Plan (pure, no ASGI)."""
