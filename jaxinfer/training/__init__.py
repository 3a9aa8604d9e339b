"""Training what serving uses (draft heads for speculative decoding); optax lives here only."""
