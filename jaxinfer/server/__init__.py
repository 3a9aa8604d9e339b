"""The OpenAI-compatible HTTP server (`jaxinfer serve`): protocol.py (request and response
shapes), async_engine.py (the engine in its own thread), metrics.py (Prometheus), app.py (routes)."""
