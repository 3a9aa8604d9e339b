"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

One sequence's linear attention, per value head, with a state S [Dk, Dv] carried across tokens
(`reference.py` has the math and every form):

    chunked(q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv], chunk_size=64)
        -> (out [T, Hv, Dv] float32, the final state [Hv, Dk, Dv] float32)

- `reference.py`: plain jnp, the truth: `recurrent` (token by token), `step` (one token per
  sequence: decode) and `chunked` (the UT-transform chunked form; the XLA path of prefill chunks);
- `tpu.py`: `chunked` as one Mosaic kernel: grid (heads "parallel", chunks "arbitrary"), the
  state in a VMEM scratch carried from chunk to chunk, each chunk's decay mask, (I + A)^-1 (by
  matmuls: `reference.unit_lower_inverse`'s product), u, w, outputs and state update in float32
  matmuls; q, k, v read in the model's [T, Hv * D] layout when the heads are whole 128-lane
  columns (Qwen's 128);
- `gpu.py`: the same as one Triton kernel: a program per head and block of value columns walks
  the chunks with a `fori_loop`, its part of the state in registers; dims padded to Triton's
  powers of two;
- `common.py`: the chunk's math both kernels run (`chunk_step`), the gates' preparation (T
  padded to whole chunks with tokens that change nothing, g summed within each chunk) and the
  kernels' cost estimate.

The model reaches them through its kernel table's `gated_delta_rule` (`jaxinfer.ops.kernels`),
called for each multi-token chunk by `jaxinfer.ops.linear_attention.ragged_delta_rule`; decodes
run `reference.step`, vectorised over the sequences.
"""
