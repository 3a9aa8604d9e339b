"""The kernel table: which implementation of each hot operation the model runs, resolved once.

    LLM(..., kernel_impl="auto" | "reference" | "pallas" | "pallas-tpu" | "pallas-gpu")
    # (attention_impl=... is accepted as an alias: the option first chose attention only)

- "reference": the XLA (plain jnp) paths: split-KV ragged attention, the LoRA delta by shape,
  dequantize-then-dot quantized matmul (and grouped matmul over a quantized stack of experts), unfused norm / SwiGLU / RoPE + scatter; what the CPU runs
  by default.
- "pallas": the Pallas kernels of the current platform: Mosaic TPU kernels on a TPU, Triton GPU
  kernels on a GPU. On the CPU, where neither compiles, it runs the TPU kernels in interpret mode
  (slow: for tests and checks, not for serving).
- "pallas-tpu" / "pallas-gpu": that platform's kernels, in interpret mode unless on that platform,
  so the GPU kernels can be checked on a CPU too.
- "auto": "pallas" on TPU and GPU, "reference" on the CPU.

`resolve_kernels` turns the choice into a `Kernels` table of named functions, one signature per
operation whatever the platform; the model and `jaxinfer.ops.attention` call each of them from
one place. A kernel that cannot take a shape (the TPU SwiGLU kernel needs 128-column halves, the
GPU RoPE kernel a power-of-two half head_dim) falls back to the XLA path inside its entry. The table is static: part of the model's
structure (tables compare equal by platform, interpret flag and `xla`), so one compiled step per
choice.

`Kernels(..., xla=("ragged_attention", ...))` runs those operations' XLA paths whatever the
platform: the on-device check (`jaxinfer.runtime.kernel_selfcheck`) puts there every kernel that
failed against its reference on the chip; it is part of the table's identity (its own compiled
step). The XLA attention reads separate K and V pools, so "ragged_attention" brings the separate
pool layout with it (`combines_kv`).

The KV pool layout is the table's too (`combines_kv`, jaxinfer.ops.kv_cache): the TPU
attention kernel reads combined pages (K and V of every head in one row per token, stored by a
TPU with no padding), every other path separate K and V pools. On a TPU the KV write into
combined pages is XLA's in-place scatter, RoPE fused in XLA: a token's row cannot be DMA'd alone
into a page whose tokens share 32-bit words (bf16, 8-bit), which Mosaic refuses.

Quantized KV pools (int8 / e4m3 entries with a scale per token and head, jaxinfer.ops.kv_cache)
are combined on a TPU too, their scales in one pool [pages, Hkv * 2 * page_size]. The TPU kernel
reads them when page_size is a multiple of 128: a page's scales of one head are then whole
128-lane rows, fetched with the page, and the pool is stored row-major and exactly. With smaller
pages a TPU stores the scale pool exactly only with the page axis in the lanes, which a page DMA
cannot fetch, so the XLA split-KV attention reads it; so it does on the CPU and the GPU (the
Triton kernel takes one scale per pool).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS, RaggedBatch
from pallas_kernels.causal_conv import gpu as conv_gpu
from pallas_kernels.causal_conv import reference as conv_reference
from pallas_kernels.causal_conv import tpu as conv_tpu
from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_tpu
from pallas_kernels.fused_rms_norm import add_rms_norm_gpu, add_rms_norm_reference, add_rms_norm_tpu
from pallas_kernels.gated_delta_rule import gpu as gdn_gpu
from pallas_kernels.gated_delta_rule import reference as gdn_reference
from pallas_kernels.gated_delta_rule import tpu as gdn_tpu
from pallas_kernels.grouped_matmul import gpu as gmm_gpu
from pallas_kernels.grouped_matmul import reference as gmm_reference
from pallas_kernels.grouped_matmul import tpu as gmm_tpu
from pallas_kernels.mla_attention import gpu as mla_gpu
from pallas_kernels.mla_attention import tpu as mla_tpu
from pallas_kernels.mla_attention.reference import as_kv_head
from pallas_kernels.lora_sgmv import lora_delta_gpu, lora_delta_tpu, lora_delta_xla
from pallas_kernels.quantized_matmul import gpu as qmm_gpu
from pallas_kernels.quantized_matmul import reference as qmm_reference
from pallas_kernels.quantized_matmul import tpu as qmm_tpu
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import split_kv
from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu
from pallas_kernels.rope_kv_write import gpu_supports, rope_kv_write_gpu, rope_kv_write_reference
from pallas_kernels.sparse24_matmul import densify as sparse24_densify
from pallas_kernels.sparse24_matmul import gpu as s24_gpu
from pallas_kernels.sparse24_matmul import tpu as s24_tpu
from pallas_kernels.swiglu_matmul import swiglu_matmul_gpu, swiglu_matmul_tpu

KERNEL_IMPLS = ("auto", "reference", "pallas", "pallas-tpu", "pallas-gpu")
# The table's operations (its other entries describe the KV pool's layout and the scale dtype).
OPERATIONS = ("ragged_attention", "flash_attention", "rope_kv_write", "quantized_matmul", "add_rms_norm", "swiglu_matmul",
              "lora_delta", "grouped_matmul", "mla_attention", "gated_delta_rule", "causal_conv", "sparse24_matmul")

# KV tokens per work item of the XLA split-KV attention, and items per loop iteration (measured
# on the CPU, 30 layers of SmolLM2's attention). Decodes (one query row per block) contract by
# products and sums ("reduce": no transposed copy of K and V) over items of 128 tokens, as many
# items per iteration as the bucket has sequences, from 2 to 16: batch 1 wants little padding per
# iteration (512 tokens of context: 2.2 ms with 2 items, 4.8 with 16), 32 sequences want few
# iterations (61-84 ms with 16 items; the former 32-token items with matmuls: 99-125 ms).
DECODE_KV_TOKENS_PER_ITEM = 128
DECODE_REDUCE_MAX_GROUP = 8  # query heads per KV head up to which decodes contract by products and sums
SPEC_KV_TOKENS_PER_ITEM = 64  # verify chunks of speculative decoding: a few queries, long contexts
PREFILL_KV_TOKENS_PER_ITEM = 128


# ----------------------------------------------------------------------------- the XLA paths
def xla_ragged_attention(q, k_pages, v_pages, page_table, batch: RaggedBatch, *, num_kv_heads: int, sm_scale: float,
                         sliding_window: int | None, query_block: int, attention_chunk: int | None = None, spec_block: int = 0, soft_cap: float | None = None, sinks=None, k_scale=None,
                         v_scale=None, lane_blocks: int = 1, outliers=None) -> jax.Array:
    """Split-KV ragged paged attention (`pallas_kernels.ragged_paged_attention.split_kv`), in
    passes over disjoint sequences: one-token ones with query blocks of 1, with spec_block the
    short chunks of speculating sequences, then the (at most MAX_PREFILL_CHUNKS) prefill chunks
    with large query blocks. Rows a pass does not serve come out as zeros, so the sum is the
    answer. A decode bucket (query_block 1) is one pass. [T, Hq, D]. `outliers`: a quantized
    pool's outlier-token residual slots (split_kv; jaxinfer.ops.kv_cache). Every pass applies the
    batch's tree masks when it has them (`batch.tree_base`, `tree_bits`)."""
    del num_kv_heads  # the XLA pools hold exactly the model's heads
    if lane_blocks != 1:
        raise ValueError("lane_blocks: only the TPU kernel reads pages as lane blocks (combined pools)")
    page_size = k_pages.shape[1]
    T, S = q.shape[0], batch.kv_lens.shape[0]
    attend = lambda query_block, kv_tokens, items, **kw: split_kv.ragged_paged_attention(  # noqa: E731
        q, k_pages, v_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, num_queries_per_block=query_block, outliers=outliers,
        num_kv_pages_per_block=max(1, kv_tokens // page_size), items_per_step=items,
        tree_base=batch.tree_base, tree_bits=batch.tree_bits, **kw,
    )
    decode_items = min(max(S, 2), 16)
    # products and sums read K and V once per query head sharing them: with many heads per KV head
    # (MLA: all of them share the latent rows) that is G times the pages, where a matmul reads them once
    contraction = "reduce" if q.shape[1] // k_pages.shape[2] <= DECODE_REDUCE_MAX_GROUP else "dot"
    if query_block == 1:
        return attend(1, DECODE_KV_TOKENS_PER_ITEM, decode_items, contraction=contraction)
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    out = attend(1, DECODE_KV_TOKENS_PER_ITEM, decode_items, seq_mask=q_lens == 1, max_query_blocks=S, contraction=contraction)
    if spec_block:
        out += attend(spec_block, SPEC_KV_TOKENS_PER_ITEM, 16, seq_mask=(q_lens > 1) & (q_lens <= spec_block), max_query_blocks=S)
    out += attend(
        query_block, PREFILL_KV_TOKENS_PER_ITEM, 8,
        seq_mask=q_lens > max(1, spec_block), max_query_blocks=min(T, -(-T // query_block) + min(S, MAX_PREFILL_CHUNKS)),
    )
    return out


def xla_mla_attention(q, latent_pages, page_table, batch: RaggedBatch, *, value_dim: int, sm_scale: float,
                      query_block: int, spec_block: int = 0, scales=None) -> jax.Array:
    """MLA attention by the split-KV XLA attention: the latent rows as the one KV head's keys and
    values (`pallas_kernels.mla_attention.reference`), the values' first value_dim entries kept;
    int8 / e4m3 rows with one scale each (`scales` [P, page_size]). [T, Hq, value_dim]."""
    rows = as_kv_head(latent_pages, q.shape[-1])
    scale = None if scales is None else scales[..., None]  # [P, page_size, 1]: the one KV head's
    return xla_ragged_attention(q, rows, rows, page_table, batch, num_kv_heads=1, sm_scale=sm_scale, sliding_window=None,
                                query_block=query_block, spec_block=spec_block, k_scale=scale,
                                v_scale=scale)[..., :value_dim]


def xla_quantized_matmul(x, qweight, scales, offsets=None, *, mode: str, group_size: int | None) -> jax.Array:
    """The reference dequantize-then-dot, on x in float32 (it computes in x's dtype). [M, N]."""
    return qmm_reference.quantized_matmul(x.astype(jnp.float32), qweight, scales, offsets, mode=mode, group_size=group_size)


def xla_sparse24_matmul(x, values, mask) -> jax.Array:
    """A 2:4 weight expanded (pallas_kernels.sparse24_matmul.densify, in the values' dtype), then
    one dense dot with f32 accumulation, as a plain weight's: the CPU's path. [M, N] in x's dtype."""
    w = sparse24_densify(values, mask)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)


def xla_swiglu_matmul(x, w_gate_up) -> jax.Array:
    """silu(x @ gate) * (x @ up): one matmul ([T, 2I] in x's dtype), then the activation in f32."""
    gate_up = jnp.dot(x.astype(w_gate_up.dtype), w_gate_up, preferred_element_type=jnp.float32).astype(x.dtype)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def same_dtype(dtype):
    return dtype


# ----------------------------------------------------------------------------- Pallas adapters
def _tpu_ragged_attention(q, k_pages, v_pages, page_table, batch: RaggedBatch, *, num_kv_heads: int, sm_scale: float,
                          sliding_window: int | None, query_block: int, attention_chunk: int | None = None, spec_block: int = 0, soft_cap: float | None = None, sinks=None, k_scale=None, v_scale=None,
                          lane_blocks: int = 1, outliers=None, interpret: bool) -> jax.Array:
    """Combined pages (v_pages None): the TPU kernel (pages as lane blocks of the pool's: `lane_blocks`), a quantized pool's scales (k_scale: the combined
    scale pool) included when its pages are whole 128-lane rows of scales (page_size a multiple of
    128), attention sinks included. Otherwise (separate pools, smaller pages of a quantized pool,
    outlier-token residuals) the XLA path."""
    if v_pages is not None or (k_scale is not None and k_pages.shape[1] % 128) or outliers is not None:
        return xla_ragged_attention(q, k_pages, v_pages, page_table, batch, num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                                    sliding_window=sliding_window, attention_chunk=attention_chunk, query_block=query_block,
                                    spec_block=spec_block, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                    outliers=outliers)
    return rpa_tpu.ragged_paged_attention(
        q, k_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs, k_scale, sinks,
        tree_base=batch.tree_base, tree_bits=batch.tree_bits, sm_scale=sm_scale,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap, num_queries_per_block=query_block,
        lane_blocks=lane_blocks, interpret=interpret)


def _gpu_ragged_attention(q, k_pages, v_pages, page_table, batch: RaggedBatch, *, num_kv_heads: int, sm_scale: float,
                          sliding_window: int | None, query_block: int, attention_chunk: int | None = None, spec_block: int = 0, soft_cap: float | None = None, sinks=None, k_scale=None, v_scale=None,
                          outliers=None, interpret: bool) -> jax.Array:
    if k_scale is not None or outliers is not None:  # a quantized pool: the XLA path (module docstring)
        return xla_ragged_attention(q, k_pages, v_pages, page_table, batch, num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                                    sliding_window=sliding_window, attention_chunk=attention_chunk, query_block=query_block,
                                    spec_block=spec_block, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                    outliers=outliers)
    return rpa_gpu.ragged_paged_attention(
        q, k_pages, v_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap, num_queries_per_block=query_block,
        interpret=interpret, sinks=sinks, tree_base=batch.tree_base, tree_bits=batch.tree_bits)


def _tpu_mla_attention(q, latent_pages, page_table, batch: RaggedBatch, *, value_dim: int, sm_scale: float,
                       query_block: int, spec_block: int = 0, scales=None, interpret: bool) -> jax.Array:
    """The TPU kernel reads float rows and values of whole 128-lane rows (DeepSeek's 512); a
    quantized pool, other widths (tiny test models) and tree masks (batch.tree_base) take the XLA path."""
    if value_dim % 128 or scales is not None or batch.tree_base is not None:
        return xla_mla_attention(q, latent_pages, page_table, batch, value_dim=value_dim, sm_scale=sm_scale,
                                 query_block=query_block, spec_block=spec_block, scales=scales)
    return mla_tpu.mla_attention(q, latent_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs,
                                 value_dim=value_dim, sm_scale=sm_scale, num_queries_per_block=query_block, interpret=interpret)


def _gpu_mla_attention(q, latent_pages, page_table, batch: RaggedBatch, *, value_dim: int, sm_scale: float,
                       query_block: int, spec_block: int = 0, scales=None, interpret: bool) -> jax.Array:
    """The Triton kernel reads float rows, the latent part as one power-of-two block (DeepSeek's
    512), then a rope part; a quantized pool, other widths and tree masks take the XLA path."""
    if value_dim < 16 or value_dim & (value_dim - 1) or scales is not None or batch.tree_base is not None:
        return xla_mla_attention(q, latent_pages, page_table, batch, value_dim=value_dim, sm_scale=sm_scale,
                                 query_block=query_block, spec_block=spec_block, scales=scales)
    return mla_gpu.mla_attention(q, latent_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs,
                                 value_dim=value_dim, sm_scale=sm_scale, num_queries_per_block=query_block, interpret=interpret)


def _gpu_rope_kv_write(*args, interpret: bool):
    if gpu_supports(args[0].shape[-1]):
        return rope_kv_write_gpu(*args, interpret=interpret)
    return rope_kv_write_reference(*args)


def _tpu_swiglu_matmul(x, w_gate_up, *, interpret: bool):
    """The TPU kernel tiles each half of the weight in blocks of 128 columns."""
    if (w_gate_up.shape[-1] // 2) % 128:
        return xla_swiglu_matmul(x, w_gate_up)
    return swiglu_matmul_tpu(x, w_gate_up, interpret=interpret)


def _tpu_scale_dtype(dtype):
    """Mosaic cannot load float16 vectors: float16 scales are placed as float32 (exact)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else dtype


# ----------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Kernels:
    """One implementation per operation (see the module docstring for each signature's source).

    ragged_attention(q [T,Hq,D], k_pages, v_pages, page_table [S,pages], batch, *, num_kv_heads,
        sm_scale, sliding_window, query_block, attention_chunk, spec_block, soft_cap, sinks, k_scale, v_scale) -> [T,Hq,D]
        (attention_chunk: Llama 4's chunked local attention, pallas_kernels.visible_span)
        (sinks [Hq]: attention sinks, GPT-OSS)
        (tree masks: the batch's `tree_base` / `tree_bits` [T] when set (draft trees,
        pallas_kernels.tree_mask), honoured by every implementation; None: causal, compiled as before)
        (k_scale / v_scale: a quantized pool's scales [pages, page_size, heads], else None; a
        combined pool comes as k_pages with v_pages None; outliers, given only when the pool keeps
        them: (token [pages, R], k_res, v_res [pages, R, heads, D]), read by the XLA path)
    flash_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, causal, attention_chunk) -> [T,Hq,D];
        None: no flash path (the XLA attention serves every step)
    rope_kv_write(q, k, v, cos, sin, k_pages, v_pages, write_page, write_offset) -> (q, k, k_pages, v_pages)
    quantized_matmul(x [M,K], qweight, scales, offsets, *, mode, group_size) -> [M,N]
    grouped_matmul(x [M,K], group_of_row [M], qweight [G,K',N], scales, offsets, *, mode, group_size) -> float32 [M,N]:
        each row times its own matrix of a quantized stack (G: none, 0 out): the experts of a MoE
        layer kept quantized (GPT-OSS's mxfp4; jaxinfer.models.moe)
    mla_attention(q [T,Hq,D], latent_pages [P,page_size,W], page_table, batch, *, value_dim, sm_scale, query_block,
        spec_block, scales) -> [T,Hq,value_dim]: multi-head latent attention over one latent row per token,
        the keys of every head and, their first value_dim entries, the values (pallas_kernels.mla_attention);
        scales [P,page_size]: an int8 / e4m3 pool's, one per row (the XLA path reads those, and tree masks)
    add_rms_norm(x, residual, weight, *, eps) -> (normed, x + residual)
    swiglu_matmul(x [T,H], w_gate_up [H,2I]) -> silu(gate) * up [T,I]
    lora_delta(x [T,K], a [N,K,P R], bs (P x [N,R,O_p]), slot [T]) -> float32 [T, sum O_p]: the
        LoRA adapters' delta of P projections sharing an input (jaxinfer.models.lora); the
        kernels group tokens by slot (SGMV), the XLA path picks its form by shape
    gated_delta_rule(q [T,Hv,Dk], k [T,Hv,Dk], v [T,Hv,Dv], g [T,Hv], beta [T,Hv], state [Hv,Dk,Dv], chunk_size)
        -> (out [T,Hv,Dv], final state), float32: one sequence's chunked gated delta rule (Gated DeltaNet
        prefill chunks, jaxinfer.ops.linear_attention; pallas_kernels.gated_delta_rule)
    causal_conv(x [T,C], before [K-1,C], weight [K,C], valid_len) -> (out [T,C], last [K-1,C]): one
        sequence's chunk through Gated DeltaNet's causal depthwise convolution, last = the K-1 inputs
        ending at valid_len (jaxinfer.ops.linear_attention; pallas_kernels.causal_conv)
    sparse24_matmul(x [M,K], values [4,K/8,N], mask uint8 [K/8,N]) -> [M,N]: a 2:4 sparse weight kept
        compressed (jaxinfer.ops.sparsity); the kernels expand it tile by tile on the chip, the XLA
        path densifies it first (pallas_kernels.sparse24_matmul)
    scale_dtype(dtype): the dtype a quantized weight's scales and offsets are placed in for the
        quantized matmul (the TPU kernel cannot load float16: float32 instead)
    """

    platform: str = "reference"  # "reference" | "tpu" | "gpu": whose kernels run
    interpret: bool = False  # Pallas kernels in interpret mode (on a platform that cannot compile them)
    xla: tuple[str, ...] = ()  # OPERATIONS that run their XLA path instead (sorted; see the module docstring)
    # The entries: filled from `platform` (an entry given explicitly is kept, unless `xla` names it).
    ragged_attention: Callable = dataclasses.field(default=None, compare=False, repr=False)
    flash_attention: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    rope_kv_write: Callable = dataclasses.field(default=None, compare=False, repr=False)
    quantized_matmul: Callable = dataclasses.field(default=None, compare=False, repr=False)
    add_rms_norm: Callable = dataclasses.field(default=None, compare=False, repr=False)
    swiglu_matmul: Callable = dataclasses.field(default=None, compare=False, repr=False)
    lora_delta: Callable = dataclasses.field(default=None, compare=False, repr=False)
    grouped_matmul: Callable = dataclasses.field(default=None, compare=False, repr=False)
    mla_attention: Callable = dataclasses.field(default=None, compare=False, repr=False)
    gated_delta_rule: Callable = dataclasses.field(default=None, compare=False, repr=False)
    causal_conv: Callable = dataclasses.field(default=None, compare=False, repr=False)
    sparse24_matmul: Callable = dataclasses.field(default=None, compare=False, repr=False)
    scale_dtype: Callable = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.platform not in _TABLES:
            raise ValueError(f"Kernels(platform={self.platform!r}): expected one of {', '.join(map(repr, _TABLES))}")
        unknown = sorted(set(self.xla) - set(OPERATIONS))
        if unknown:
            raise ValueError(f"Kernels(xla={tuple(self.xla)!r}): {', '.join(map(repr, unknown))} is no operation of the "
                             f"kernel table (expected some of {', '.join(map(repr, OPERATIONS))})")
        object.__setattr__(self, "xla", tuple(sorted(set(self.xla))))
        xla = _xla_table(self.interpret)
        for name, fn in _TABLES[self.platform](self.interpret).items():
            if name in self.xla:
                object.__setattr__(self, name, xla[name])
            elif getattr(self, name) is None:
                object.__setattr__(self, name, fn)

    @property
    def pallas(self) -> bool:
        return self.platform != "reference"

    @property
    def combines_kv(self) -> bool:
        """Whether the KV pool is combined (one row of K and V per token: what the TPU attention
        kernel reads) or separate K and V pools (every other attention, the XLA fallback
        included), for every dtype (jaxinfer.ops.kv_cache)."""
        return self.platform == "tpu" and "ragged_attention" not in self.xla


def _xla_table(interpret: bool) -> dict[str, Callable | None]:
    return dict(ragged_attention=xla_ragged_attention, flash_attention=None, rope_kv_write=rope_kv_write_reference,
                quantized_matmul=xla_quantized_matmul, add_rms_norm=add_rms_norm_reference, swiglu_matmul=xla_swiglu_matmul,
                lora_delta=lora_delta_xla, grouped_matmul=gmm_reference.grouped_quantized_matmul,
                mla_attention=xla_mla_attention, gated_delta_rule=gdn_reference.chunked, causal_conv=conv_reference.causal_conv,
                sparse24_matmul=xla_sparse24_matmul,
                scale_dtype=same_dtype)


def _tpu_table(interpret: bool) -> dict[str, Callable]:
    pallas = functools.partial(functools.partial, interpret=interpret)  # f -> f(..., interpret=interpret)
    return dict(ragged_attention=pallas(_tpu_ragged_attention), flash_attention=pallas(flash_attention_tpu),
                rope_kv_write=rope_kv_write_reference, quantized_matmul=pallas(qmm_tpu.quantized_matmul),
                add_rms_norm=pallas(add_rms_norm_tpu), swiglu_matmul=pallas(_tpu_swiglu_matmul), lora_delta=pallas(lora_delta_tpu),
                grouped_matmul=pallas(gmm_tpu.grouped_quantized_matmul), mla_attention=pallas(_tpu_mla_attention),
                gated_delta_rule=pallas(gdn_tpu.chunked), causal_conv=pallas(conv_tpu.causal_conv),
                sparse24_matmul=pallas(s24_tpu.sparse24_matmul),
                scale_dtype=_tpu_scale_dtype)


def _gpu_table(interpret: bool) -> dict[str, Callable]:
    pallas = functools.partial(functools.partial, interpret=interpret)
    return dict(ragged_attention=pallas(_gpu_ragged_attention), flash_attention=pallas(flash_attention_gpu),
                rope_kv_write=pallas(_gpu_rope_kv_write), quantized_matmul=pallas(qmm_gpu.quantized_matmul),
                add_rms_norm=pallas(add_rms_norm_gpu), swiglu_matmul=pallas(swiglu_matmul_gpu), lora_delta=pallas(lora_delta_gpu),
                grouped_matmul=pallas(gmm_gpu.grouped_quantized_matmul), mla_attention=pallas(_gpu_mla_attention),
                gated_delta_rule=pallas(gdn_gpu.chunked), causal_conv=pallas(conv_gpu.causal_conv),
                sparse24_matmul=pallas(s24_gpu.sparse24_matmul),
                scale_dtype=same_dtype)


_TABLES = {"reference": _xla_table, "tpu": _tpu_table, "gpu": _gpu_table}


def resolve_kernels(kernel_impl: str, backend: str | None = None, xla: tuple[str, ...] = ()) -> Kernels:
    """kernel_impl (see the module docstring) on `backend` (default: JAX's default backend) -> the
    table; `xla`: operations that run their XLA path all the same (Kernels.xla)."""
    if kernel_impl not in KERNEL_IMPLS:
        raise ValueError(f"kernel_impl={kernel_impl!r}: expected one of {', '.join(map(repr, KERNEL_IMPLS))}")
    backend = backend or jax.default_backend()
    if backend in ("cuda", "rocm"):
        backend = "gpu"
    if kernel_impl == "auto":
        kernel_impl = "reference" if backend == "cpu" else "pallas"
    if kernel_impl == "reference":
        return Kernels()
    if kernel_impl == "pallas":
        platform = backend if backend in ("tpu", "gpu") else "tpu"
    else:
        platform = kernel_impl.removeprefix("pallas-")
    return Kernels(platform, interpret=platform != backend, xla=tuple(xla))
