"""The OpenAI-compatible server over the engine: routes, request parsing and response shapes, the page, metrics."""
