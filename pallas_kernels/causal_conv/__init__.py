"""The causal depthwise convolution of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over one
sequence's prefill chunk (`reference.py` has the math):

    causal_conv(x [T, C], before [K - 1, C], weight [K, C], valid_len)
        -> (out [T, C] = sum_j weight[j] * concat(before, x)[t + j] in float32, cast to x's dtype;
            last [K - 1, C]: the K - 1 inputs ending at valid_len, the sequence's next `before`)

C is the q | k | v channels (10240 for Qwen3.5-27B, 8192 for the 35B-A3B), K = 4 taps; rows from
valid_len on are padding (the ragged step gathers each chunk into the step's T rows).

- `reference.py`: plain jnp, the truth and the kernel table's XLA path; the kernels' cost;
- `tpu.py`: one Mosaic kernel: grid (channel blocks of 128-lane multiples "parallel", token blocks
  "arbitrary"), the K - 1 inputs before each token block carried in a float32 VMEM scratch, each
  tap a sublane-shifted view of it; T and C padded to whole blocks by the wrapper;
- `gpu.py`: one Triton kernel: a program per channel block walks the token blocks with a
  `fori_loop`, each tap a masked load at a row offset (the rows before the chunk from `before`);
  nothing padded.

The model reaches them through its kernel table's `causal_conv` (`jaxinfer.ops.kernels`), called
for each multi-token chunk by `jaxinfer.ops.linear_attention.ragged_causal_conv`; decodes and
speculative decoding's short chunks stay on its vectorised XLA path.
"""
