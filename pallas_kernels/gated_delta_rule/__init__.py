"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5): see `reference.py`."""
