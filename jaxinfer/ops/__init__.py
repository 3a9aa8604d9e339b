"""Operations below the model: attention over the paged KV cache, the ragged batch, the KV
cache, sampling, quantized weights, and the kernel table that picks XLA or Pallas for each."""
