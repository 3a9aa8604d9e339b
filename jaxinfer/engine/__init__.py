"""Host side of the engine: requests, the model runner (packs batches, calls the jitted step) and
the driver loop that decides what runs each iteration."""
