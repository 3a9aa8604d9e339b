"""The gated delta rule's Pallas kernels (pallas_kernels.gated_delta_rule: Mosaic TPU and Triton
GPU), in interpret mode on the CPU, against the jnp reference's chunked and recurrent forms: T not
a multiple of the chunk (padding tokens that change nothing), a state carried in, heads of 128
(the TPU kernel's lane-aligned layout, the GPU kernel's value columns over several programs) and
of sizes no chip tiles (the TPU kernel's transposed layout, the GPU kernel's padding to powers of
two); then the kernel table's entry where Gated DeltaNet layers call it (a ragged step of a
decode, a fresh chunk and a continued one), a tiny Qwen3.5 whose prompt log-probabilities are
the reference's with the kernel in place (and the causal conv's: tests/test_causal_conv_kernels.py),
and the on-device check's case for it (jaxinfer.runtime.kernel_selfcheck). (libtpu and the CUDA
plugin compile the kernels at Qwen3.5's shapes in tests/test_aot.py.)
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.kernels import OPERATIONS, Kernels
from pallas_kernels.gated_delta_rule import gpu, reference, tpu

KERNELS = {"tpu": functools.partial(tpu.chunked, interpret=True), "gpu": functools.partial(gpu.chunked, interpret=True)}
TOLERANCE = 1e-4  # of the largest |value| (at least 1)


def inputs(T, H, Dk, Dv, seed=0):
    """q, k [T, H, Dk] as the model prepares them (L2-normalised, q scaled), v [T, H, Dv], log
    decays g <= 0 and rates beta in (0, 1) [T, H], a non-zero state [H, Dk, Dv], float32."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q = reference.l2_normalize(normal(T, H, Dk)) * Dk**-0.5
    k = reference.l2_normalize(normal(T, H, Dk))
    g = -0.3 * jnp.abs(normal(T, H))
    return q, k, normal(T, H, Dv), g, jax.nn.sigmoid(normal(T, H)), 0.3 * normal(H, Dk, Dv)


def assert_close(got, want):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        assert np.abs(g - w).max() <= TOLERANCE * max(1.0, np.abs(w).max())


# (T, H, Dk, Dv, chunk): two chunks of 64, the second padded (Qwen's chunk); heads of 128 in 16-token
# chunks; sizes no chip tiles (Dk 8, Dv 20)
CASES = [(70, 3, 16, 32, 64), (40, 2, 128, 128, 16), (37, 2, 8, 20, 16)]


@pytest.mark.parametrize("T,H,Dk,Dv,chunk", CASES, ids=[f"T{c[0]}-H{c[1]}-Dk{c[2]}-Dv{c[3]}-C{c[4]}" for c in CASES])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernel_equals_the_chunked_and_recurrent_references(platform, T, H, Dk, Dv, chunk):
    args = inputs(T, H, Dk, Dv)
    got = KERNELS[platform](*args, chunk_size=chunk)
    assert got[0].shape == (T, H, Dv) and got[1].shape == (H, Dk, Dv)
    assert got[0].dtype == got[1].dtype == jnp.float32
    assert_close(got, reference.chunked(*args, chunk_size=chunk))
    assert_close(got, reference.recurrent(*args))


def test_the_gpu_kernel_splits_value_columns_over_programs_and_takes_bfloat16_inputs():
    """block_v 16: four programs per head of 64 value columns, each its own columns of the state;
    bf16 q, k, v (read as float32 in the kernel) give the reference on the same rounded values."""
    q, k, v, g, beta, state = inputs(21, 2, 16, 64, seed=1)
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    got = gpu.chunked(q, k, v, g, beta, state, chunk_size=16, block_v=16, interpret=True)
    assert_close(got, reference.recurrent(q, k, v, g, beta, state))


def test_chunk_sizes_the_kernels_cannot_take_are_refused():
    args = inputs(8, 1, 16, 16)
    with pytest.raises(ValueError, match="power of two >= 8"):
        tpu.chunked(*args, chunk_size=12, interpret=True)
    with pytest.raises(ValueError, match="power of two >= 16"):
        gpu.chunked(*args, chunk_size=8, interpret=True)


def test_the_kernel_table_runs_the_platforms_kernel_or_the_reference():
    assert "gated_delta_rule" in OPERATIONS
    assert Kernels().gated_delta_rule is reference.chunked
    assert Kernels("tpu", interpret=True).gated_delta_rule.func is tpu.chunked
    assert Kernels("gpu", interpret=True).gated_delta_rule.func is gpu.chunked
    assert Kernels("gpu", interpret=True, xla=("gated_delta_rule",)).gated_delta_rule is reference.chunked


def pallas_calls(jaxpr) -> list[tuple[str, bool]]:
    """(name, declares a cost estimate) of every pallas_call in a jaxpr, nested ones (loops, conds,
    jits) included."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append((eqn.params["name"], eqn.params.get("cost_estimate") is not None))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names += pallas_calls(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names += pallas_calls(sub)
    return names


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_a_ragged_step_runs_its_chunks_through_the_kernel_table(platform):
    """A decode (one-token step), a fresh 9-token chunk and a 12-token chunk continuing a saved
    state: with a platform's table the chunks run its kernel (the one pallas_call of the step,
    declaring its cost to XLA) and every output and slot equals the reference path's."""
    from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch
    from jaxinfer.ops.linear_attention import ragged_delta_rule

    H, Dk, Dv = 2, 16, 16
    q, k, v, g, beta, state = inputs(32, H, Dk, Dv, seed=2)
    table = jnp.zeros((5, H, Dk, Dv), jnp.float32).at[2].set(state).at[4].set(-state)
    chunks = [SequenceChunk([0], 6, [[1, 2]], [0], state_slot=2), SequenceChunk([0] * 9, 0, [[3, 4, 5]], [8], state_slot=3),
              SequenceChunk([0] * 12, 7, [[6, 7, 8, 9, 10]], [11], state_slot=4)]
    _, batch, _ = pack_batch(chunks, Buckets((32,), max_num_seqs=4, pages_per_seq=5), page_size=4)
    run = lambda kernels: lambda *a: ragged_delta_rule(*a, table, batch, chunks=True, kernels=kernels)[:2]  # noqa: E731
    kernels = Kernels(platform, interpret=True)
    assert pallas_calls(jax.make_jaxpr(run(kernels))(q, k, v, g, beta).jaxpr) == [("gated_delta_rule_chunked", True)]
    assert_close(run(kernels)(q, k, v, g, beta), run(None)(q, k, v, g, beta))


def test_a_tiny_qwen3_5_gives_the_reference_prompt_logprobs_with_the_tpu_kernels(tmp_path):
    """Two prompts prefilled in chunks of 8 tokens (the second continues its first chunk's state and
    saved conv inputs): every prompt token's log-probability with the TPU's Gated DeltaNet kernels,
    the delta rule and the causal conv (interpret mode; the other operations on their XLA paths),
    equals the reference model's."""
    from jaxinfer import LLM, SamplingParams
    from tiny_models import save_hf_model

    save_hf_model("qwen3_5_text", tmp_path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (13, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    small = dict(max_model_len=32, page_size=4, max_num_batched_tokens=8, max_num_seqs=2, num_pages=32, progress=False)

    def prompt_logprobs(**kernels):
        llm = LLM(str(tmp_path), **small, **kernels)
        return [[next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
                for out in llm.generate(prompts, params, use_tqdm=False)]

    others = tuple(op for op in OPERATIONS if op not in ("gated_delta_rule", "causal_conv"))
    got = prompt_logprobs(kernel_impl="pallas-tpu", xla_kernels=others)
    want = prompt_logprobs(kernel_impl="reference")
    assert [len(p) for p in got] == [12, 5]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-4)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_on_device_check_passes_the_kernel_and_fails_a_wrong_one(platform):
    """jaxinfer.runtime.kernel_selfcheck: a hybrid model's step shapes hold its delta rule's heads,
    whose one case (a prefill chunk of 135 tokens from a saved state) the kernel passes and a kernel
    with a wrong final state fails."""
    from jaxinfer.runtime.kernel_selfcheck import StepShapes, run_checks

    shapes = StepShapes(num_heads=2, num_kv_heads=1, head_dim=64, hidden=128, dtype="float32", norm_dtype="float32",
                        rms_norm_eps=1e-5, page_size=4, kv_dtype="float32", linear=(2, 16, 16))
    kernels = Kernels(platform, interpret=True)
    [verdict] = run_checks(kernels, shapes, operations=["gated_delta_rule"])
    assert verdict.verdict == "pass" and "T=135 Hv=2 Dk=16 Dv=16" in verdict.case, verdict

    def wrong(*args, **kw):
        out, state = kernels.gated_delta_rule(*args, **kw)
        return out, state + 1.0

    [verdict] = run_checks(Kernels(platform, interpret=True, gated_delta_rule=wrong), shapes, operations=["gated_delta_rule"])
    assert verdict.failed
