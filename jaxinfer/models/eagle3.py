"""EAGLE-3 draft heads in the published format (the folders vLLM, SGLang and SpecForge load), run
as a speculative proposer (jaxinfer.engine.eagle3).

An EAGLE-3 head is one Llama decoder layer that reads, beside each token, the target's residual
streams at the input of three of its layers (by default layers 2, L // 2 and L - 3 of an L-layer
target; `eagle_config.eagle_aux_hidden_state_layer_ids` names others). At position p it reads
the target's streams of position p and the token t_{p+1}, and guesses t_{p+2}:

    x_p    = fc([a_p | b_p | c_p])                      # [3 * Ht] -> [H]: the three streams
             (or, guessing again from its own guess, the head's own pre-norm output at p - 1)
    e_p    = input_layernorm(embed(t_{p+1}))            # the target's embedding unless the head has one
    h_p    = [e_p | hidden_norm(x_p)]                   # [2H]: q/k/v read both
    y_p    = x_p + attention(h_p)                       # RoPE at p, over a KV cache of its own
    s_p    = y_p + mlp(post_attention_layernorm(y_p))   # the pre-norm output: what the next guess reads
    logits = lm_head(norm(s_p))                         # [draft_vocab], put at target ids d + d2t[d]
                                                        # (every other target id: -inf)

Here it is a one-layer `Decoder` (`Eagle3Head`): `step_input` gives [embed | x] per token from
the step's `input_hidden` (the target's aux streams, 3 * Ht wide, go through fc; the head's own
stream, H wide, does not), `run_layers` runs the layer above and `_lm_head` maps the draft
vocabulary into the target's. The target returns the aux streams from its own step
(`StepFunction(return_stream=layers)`), so nothing runs twice.

The published folder: config.json (`architectures: ["LlamaForCausalLMEagle3"]`, Llama fields with
num_hidden_layers 1, `draft_vocab_size`, optional `target_hidden_size` and `eagle_config`) and
safetensors with `fc.weight [H, 3Ht]`, `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v [out, 2H]),
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight [draft_vocab, H]`,
`d2t [draft_vocab]` (target id - draft id), `t2d [vocab]` (bool) and optionally
`embed_tokens.weight`; a "model." prefix is accepted. `load_eagle3` reads one (naming any missing
or misshapen tensor), `save_eagle3` writes one, `init_eagle3` makes a random one, and
`eagle3_forward` is the same head over whole sequences in plain jnp (training, tests).

Aux layer ids follow vLLM: the stream at the *input* of each named layer (SGLang reads an explicit
eagle_config list as layer outputs, i.e. inputs of id + 1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from checkpoints_conv.hf import SafetensorsSource
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models.decoder import Decoder, LayerRef
from jaxinfer.models.layers import matmul, rms_norm
from jaxinfer.models.rope import rope_cos_sin
from jaxinfer.ops.kernels import Kernels
from pallas_kernels.rope_kv_write.reference import apply_rope

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
    """What a head folder says beyond its Llama layer: `config` (the layer as a one-layer Llama
    ModelConfig whose vocab is the target's), the draft vocabulary's size, the target's hidden
    size it reads, the target layers whose input streams it reads, whether it has an embedding."""

    config: ModelConfig
    draft_vocab: int
    target_hidden: int
    aux_layers: tuple[int, ...]
    has_embed: bool


class Eagle3Head(Decoder):
    """The head as a one-layer decoder (see the module docstring); its weights beyond a Llama
    layer's: `fc` [3Ht, H], `layers.hidden_norm` [1, H], `lm_head` [H, Vd] and `draft_ids` [Vd]
    (each draft id's target id), and `layers.qkv_proj` reads 2H."""

    def __init__(self, config: ModelConfig, *, draft_vocab: int, target_hidden: int, param_dtype=jnp.float32,
                 compute_dtype=jnp.float32, kernels: Kernels = Kernels(), rngs: nnx.Rngs):
        super().__init__(config, param_dtype=param_dtype, compute_dtype=compute_dtype, kernels=kernels, rngs=rngs)
        H = config.hidden_size
        qkv = self.layers.qkv_proj.get_value()
        self.layers.qkv_proj = nnx.Param(jnp.zeros((1, 2 * H, qkv.shape[-1]), param_dtype))
        self.layers.hidden_norm = nnx.Param(jnp.ones((1, H), param_dtype))
        self.fc = nnx.Param(jnp.zeros((3 * target_hidden, H), param_dtype))
        self.lm_head = nnx.Param(jnp.zeros((H, draft_vocab), param_dtype))
        self.draft_ids = nnx.Param(jnp.arange(draft_vocab, dtype=jnp.int32))

    def step_input(self, token_ids: jax.Array, positions: jax.Array, input_hidden: jax.Array | None) -> jax.Array:
        """[Tl, 2H] = [embed(token) | x]: x = fc(aux streams) when input_hidden is the target's
        [Tl, 3Ht], else input_hidden itself (the head's own stream, [Tl, H])."""
        if input_hidden is None:
            raise ValueError("an EAGLE-3 head reads a hidden state per token (batch.hidden_src)")
        H, e = self.config.hidden_size, self._embed(token_ids)  # [Tl, H]
        x = input_hidden.astype(self.compute_dtype)
        if x.shape[-1] == self.fc.shape[0]:
            x = matmul(x, self.fc.get_value(), self.kernels).astype(self.compute_dtype)
        elif x.shape[-1] != H:
            raise ValueError(f"an EAGLE-3 head reads hidden states of width {self.fc.shape[0]} (the target's aux "
                             f"streams) or {H} (its own), not {x.shape[-1]}")
        return jnp.concatenate([e, x], axis=-1)

    def run_layers(self, step, carry, capture: tuple[int, ...] = ()):
        """The one layer over carry = ([embed | x] [Tl, 2H], unused, pool) -> ((mlp out, residual, pool), {})."""
        if capture:
            raise ValueError("an EAGLE-3 head returns its output stream only")
        ex, _, pool = carry
        H, c = self.config.hidden_size, self.config
        w = {name: a[0] for name, a in self.layers.stacked().items()}
        e, x = ex[:, :H], ex[:, H:]
        h = jnp.concatenate([self.norm(e, w["attn_norm"]), self.norm(x, w["hidden_norm"])], axis=-1)  # [Tl, 2H]
        layer = LayerRef(0, self.kv_groups.group_of_layer[0], self.kv_groups.slot_of_layer[0])
        attn, pool = self.attention(step, layer, c.layer_kinds()[0], w, None, h, pool)
        h, residual = self.add_norm(attn, x, w["mlp_norm"])  # residual = x + attention
        return (self.dense_mlp(step, w, None, h), residual, pool), {}

    def _lm_head(self, h: jax.Array) -> jax.Array:
        """h [R, H] -> logits [R, V] float32: the draft vocabulary's at their target ids, -inf elsewhere."""
        logits = matmul(h, self.lm_head.get_value(), self.kernels).astype(jnp.float32)  # [R, Vd]
        full = jnp.full((h.shape[0], self.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, self.draft_ids.get_value()].set(logits)


# ---------------------------------------------------------------------------------------- the folder
def read_eagle3_config(path: str | Path, target: ModelConfig) -> Eagle3Spec:
    """The head folder's config.json checked against the target's config; ValueError naming the
    field at fault."""
    path = Path(path)
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not an EAGLE-3 head folder (config.json: {e})") from None
    has_embed = any(name.removeprefix("model.") == "embed_tokens.weight" for name in _listing(path))
    return eagle3_spec(d, target, has_embed=has_embed, where=path)


def eagle3_spec(d: dict, target: ModelConfig, *, has_embed: bool = False, where: str | Path = "EAGLE-3 head") -> Eagle3Spec:
    """A head's config.json dict `d` checked against the target's config (see read_eagle3_config)."""
    path = where
    archs = d.get("architectures") or []
    if ARCHITECTURE not in archs and not any("Eagle3" in a for a in archs):
        raise ValueError(f"{path}/config.json: architectures={archs!r}, expected [{ARCHITECTURE!r}]")
    if d.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}/config.json: num_hidden_layers={d['num_hidden_layers']}; EAGLE-3 heads of one layer are supported")
    if d.get("norm_before_residual"):
        raise ValueError(f"{path}/config.json: norm_before_residual=true is not supported")
    V = d.get("vocab_size", target.vocab_size)
    if V != target.vocab_size:
        raise ValueError(f"{path}/config.json: vocab_size={V}, the target's is {target.vocab_size}")
    draft_vocab = int(d.get("draft_vocab_size") or V)
    if not 0 < draft_vocab <= V:
        raise ValueError(f"{path}/config.json: draft_vocab_size={draft_vocab} must be in 1..{V}")
    target_hidden = int(d.get("target_hidden_size") or d["hidden_size"])
    if target_hidden != target.hidden_size:
        raise ValueError(f"{path}/config.json: target_hidden_size={target_hidden}, the target's hidden size is "
                         f"{target.hidden_size}")
    L = target.num_layers
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or any(not 0 <= i < L for i in ids):
        raise ValueError(f"{path}/config.json: aux hidden-state layers {list(ids)}: need three layers of the target's "
                         f"0..{L - 1} (set eagle_config.eagle_aux_hidden_state_layer_ids for a target of {L} layers)")
    llama = {**d, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
             "tie_word_embeddings": False, "vocab_size": V,
             "max_position_embeddings": d.get("max_position_embeddings", target.max_position_embeddings)}
    llama.pop("quantization_config", None)
    try:
        config = ModelConfig.from_hf_dict(llama, source=f"{path}/config.json")
    except ConfigError as e:
        raise ValueError(f"{path}: {e}") from None
    if config.is_moe or config.qk_norm or config.layer_kinds()[0].window or config.mrope_section is not None:
        raise ValueError(f"{path}/config.json: an EAGLE-3 head is a plain Llama layer (no experts, q/k norms, windows)")
    if not has_embed and config.hidden_size != target.hidden_size:
        raise ValueError(f"{path}: hidden_size={config.hidden_size} differs from the target's {target.hidden_size} "
                         "and the head has no embed_tokens.weight of its own")
    return Eagle3Spec(config, draft_vocab, target_hidden, ids, has_embed)


def _listing(path: Path) -> dict[str, tuple[int, ...]]:
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no .safetensors file")
    with SafetensorsSource(path) as source:
        return dict(source.listing())


def published_shapes(spec: Eagle3Spec) -> dict[str, tuple[int, ...]]:
    """Published tensor name -> shape of a head of `spec` (embed_tokens.weight only with has_embed)."""
    c = spec.config
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = {
        "fc.weight": (H, 3 * spec.target_hidden),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (c.num_heads * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (c.num_kv_heads * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (c.num_kv_heads * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, c.num_heads * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (spec.draft_vocab, H), "d2t": (spec.draft_vocab,), "t2d": (c.vocab_size,),
    }
    if spec.has_embed:
        shapes["embed_tokens.weight"] = (c.vocab_size, H)
    return shapes


def read_eagle3_tensors(path: str | Path, spec: Eagle3Spec) -> dict[str, np.ndarray]:
    """The folder's tensors by published name (a "model." prefix dropped), each checked against
    `published_shapes`; ValueError naming a missing, misshapen or unknown tensor."""
    path, want = Path(path), published_shapes(spec)
    listing = _listing(path)
    names = {name.removeprefix("model."): name for name in listing}
    missing = sorted(set(want) - set(names) - {"t2d"})  # (t2d is implied by d2t)
    if missing:
        raise ValueError(f"{path}: EAGLE-3 head without tensor(s) {missing}")
    unknown = sorted(set(names) - set(want))
    if unknown:
        raise ValueError(f"{path}: unexpected tensor(s) {unknown} in an EAGLE-3 head")
    out = {}
    with SafetensorsSource(path) as source:
        for name, stored in names.items():
            if tuple(listing[stored]) != want[name]:
                raise ValueError(f"{path}: tensor {stored} has shape {tuple(listing[stored])}, expected {want[name]}")
            out[name] = np.asarray(source.read(stored))
    draft_ids = np.arange(spec.draft_vocab) + out["d2t"].astype(np.int64)
    if draft_ids.min() < 0 or draft_ids.max() >= spec.config.vocab_size or len(np.unique(draft_ids)) != len(draft_ids):
        raise ValueError(f"{path}: d2t maps draft ids outside the target's vocabulary of {spec.config.vocab_size}, or two "
                         f"onto one target id")
    return out


def internal_params(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Published tensors -> the head's parameters (flat names of `Eagle3Head`, [in, out] float32)."""
    t = {k: np.asarray(v, np.float32) if k not in ("d2t", "t2d") else v for k, v in tensors.items()}
    a = "midlayer.self_attn."
    p = {
        "fc": t["fc.weight"].T,
        "layers.attn_norm": t["midlayer.input_layernorm.weight"][None],
        "layers.hidden_norm": t["midlayer.hidden_norm.weight"][None],
        "layers.qkv_proj": np.concatenate([t[a + f"{x}_proj.weight"].T for x in "qkv"], axis=1)[None],
        "layers.o_proj": t[a + "o_proj.weight"].T[None],
        "layers.mlp_norm": t["midlayer.post_attention_layernorm.weight"][None],
        "layers.gate_up_proj": np.concatenate([t["midlayer.mlp.gate_proj.weight"].T, t["midlayer.mlp.up_proj.weight"].T],
                                              axis=1)[None],
        "layers.down_proj": t["midlayer.mlp.down_proj.weight"].T[None],
        "final_norm": t["norm.weight"],
        "lm_head": t["lm_head.weight"].T,
        "draft_ids": (np.arange(len(t["d2t"])) + t["d2t"].astype(np.int64)).astype(np.int32),
    }
    if "embed_tokens.weight" in t:
        p["embed"] = t["embed_tokens.weight"]
    return p


def published_tensors(params: dict, spec: Eagle3Spec) -> dict[str, np.ndarray]:
    """The inverse of `internal_params`: the head's parameters -> published tensors (float32;
    d2t int64, t2d bool)."""
    c = spec.config
    p = {k: np.asarray(v) for k, v in params.items()}
    H, D = c.hidden_size, c.head_dim
    qkv = p["layers.qkv_proj"][0].astype(np.float32)
    q_end, k_end = c.num_heads * D, (c.num_heads + c.num_kv_heads) * D
    gate_up = p["layers.gate_up_proj"][0].astype(np.float32)
    I = gate_up.shape[1] // 2
    draft_ids = p["draft_ids"].astype(np.int64)
    t2d = np.zeros(c.vocab_size, bool)
    t2d[draft_ids] = True
    out = {
        "fc.weight": p["fc"].T, "midlayer.input_layernorm.weight": p["layers.attn_norm"][0],
        "midlayer.hidden_norm.weight": p["layers.hidden_norm"][0],
        "midlayer.self_attn.q_proj.weight": qkv[:, :q_end].T, "midlayer.self_attn.k_proj.weight": qkv[:, q_end:k_end].T,
        "midlayer.self_attn.v_proj.weight": qkv[:, k_end:].T, "midlayer.self_attn.o_proj.weight": p["layers.o_proj"][0].T,
        "midlayer.post_attention_layernorm.weight": p["layers.mlp_norm"][0],
        "midlayer.mlp.gate_proj.weight": gate_up[:, :I].T, "midlayer.mlp.up_proj.weight": gate_up[:, I:].T,
        "midlayer.mlp.down_proj.weight": p["layers.down_proj"][0].T, "norm.weight": p["final_norm"],
        "lm_head.weight": p["lm_head"].T, "d2t": draft_ids - np.arange(len(draft_ids)), "t2d": t2d,
    }
    if "embed" in p:
        out["embed_tokens.weight"] = p["embed"]
    return {k: np.ascontiguousarray(v if k in ("d2t", "t2d") else np.asarray(v, np.float32)) for k, v in out.items()}


def save_eagle3(path: str | Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """Writes a head folder: config.json (`config`, the architecture set) and model.safetensors
    (`tensors` by published name)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**config, "architectures": [ARCHITECTURE], "num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def head_config_dict(target: ModelConfig, *, draft_vocab: int, num_heads: int | None = None, num_kv_heads: int | None = None,
                     head_dim: int | None = None, intermediate_size: int | None = None,
                     aux_layers: tuple[int, ...] | None = None) -> dict:
    """A config.json for a head over `target` (its hidden size, vocabulary, RoPE and norm eps;
    the attention and MLP shapes default to the target's)."""
    c = target
    d = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size, "num_attention_heads": num_heads or c.num_heads,
         "num_key_value_heads": num_kv_heads or c.num_kv_heads, "head_dim": head_dim or c.head_dim,
         "intermediate_size": intermediate_size or c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
         "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
         "draft_vocab_size": draft_vocab, "target_hidden_size": c.hidden_size, "hidden_act": "silu",
         "tie_word_embeddings": False}
    if aux_layers is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    return d


def init_eagle3(spec: Eagle3Spec, draft_ids: np.ndarray, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random parameters of a head (`Eagle3Head` names; norms near 1, matrices ~ scale / sqrt(fan in))."""
    c, rng = spec.config, np.random.default_rng(seed)
    H, D, I, Ht = c.hidden_size, c.head_dim, c.intermediate_size, spec.target_hidden
    qkv = (c.num_heads + 2 * c.num_kv_heads) * D

    def mat(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-2])).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal((1, H))).astype(np.float32)

    return {"fc": mat(3 * Ht, H), "layers.attn_norm": norm(), "layers.hidden_norm": norm(),
            "layers.qkv_proj": mat(1, 2 * H, qkv), "layers.o_proj": mat(1, c.num_heads * D, H), "layers.mlp_norm": norm(),
            "layers.gate_up_proj": mat(1, H, 2 * I), "layers.down_proj": mat(1, I, H), "final_norm": norm()[0],
            "lm_head": mat(H, len(draft_ids)), "draft_ids": np.asarray(draft_ids, np.int32)}


# ---------------------------------------------------------------------------------------- building
def build_eagle3(spec: Eagle3Spec, params: dict[str, np.ndarray], embed, *, param_dtype=jnp.float32,
                 compute_dtype=jnp.float32, kernels: Kernels = Kernels()) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the `Eagle3Head` with `params` (`internal_params`); `embed`: the
    target's embedding table (as placed, maybe quantized), used when params has none."""
    abstract = nnx.eval_shape(lambda: Eagle3Head(spec.config, draft_vocab=spec.draft_vocab, target_hidden=spec.target_hidden,
                                                 param_dtype=param_dtype, compute_dtype=compute_dtype, kernels=kernels,
                                                 rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values = {}
    for key, var in flat.items():
        name = ".".join(str(k) for k in key)
        if name == "embed" and "embed" not in params:
            values[key] = embed
            continue
        if name not in params:
            raise ValueError(f"EAGLE-3 head: no value for parameter {name}")
        a = params[name]
        if tuple(a.shape) != tuple(var.get_value().shape):
            raise ValueError(f"EAGLE-3 head: parameter {name} has shape {tuple(a.shape)}, expected {tuple(var.get_value().shape)}")
        values[key] = jnp.asarray(a, jnp.int32 if name == "draft_ids" else param_dtype)
    for key, var in flat.items():
        var.set_value(values[key])
    return graphdef, nnx.from_flat_state(flat)


def load_eagle3(path: str | Path, target: ModelConfig, embed, **kw) -> tuple[Eagle3Spec, nnx.GraphDef, nnx.State]:
    """A published head folder over `target` (see `build_eagle3` for `embed` and the keywords)."""
    spec = read_eagle3_config(path, target)
    graphdef, state = build_eagle3(spec, internal_params(read_eagle3_tensors(path, spec)), embed, **kw)
    return spec, graphdef, state


# ---------------------------------------------------------------------------------------- whole sequences
def eagle3_forward(params: dict, spec: Eagle3Spec, embed: jax.Array, x: jax.Array, token_ids: jax.Array):
    """The head over whole sequences with causal attention, no cache (training; tests): x [B, T, 3Ht]
    (the target's aux streams) or [B, T, H] (a previous unrolled step's pre-norm outputs, shifted);
    token_ids [B, T] (each row's next token). Returns (draft logits [B, T, Vd] float32, pre-norm
    outputs [B, T, H]); row t sits at position t."""
    c = spec.config
    H, D, eps = c.hidden_size, c.head_dim, c.rms_norm_eps
    B, T = token_ids.shape
    x = x.astype(jnp.float32)
    if x.shape[-1] != H:
        x = x @ params["fc"]
    e = jnp.asarray(params.get("embed", embed))[token_ids].astype(jnp.float32)
    h = jnp.concatenate([rms_norm(e, params["layers.attn_norm"][0], eps), rms_norm(x, params["layers.hidden_norm"][0], eps)],
                        axis=-1)
    qkv = h @ params["layers.qkv_proj"][0]  # [B, T, (Hq + 2Hkv) D]
    Hq, Hkv = c.num_heads, c.num_kv_heads
    q = qkv[..., : Hq * D].reshape(B, T, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hkv) * D].reshape(B, T, Hkv, D)
    v = qkv[..., (Hq + Hkv) * D :].reshape(B, T, Hkv, D)
    positions = jnp.arange(T)
    cos, sin = rope_cos_sin(c, positions, jnp.full((T,), T))
    q = jax.vmap(lambda a: apply_rope(a, cos, sin))(q)
    k = jax.vmap(lambda a: apply_rope(a, cos, sin))(k)
    k, v = jnp.repeat(k, Hq // Hkv, axis=2), jnp.repeat(v, Hq // Hkv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c.sm_scale
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, Hq * D)
    y = x + attn @ params["layers.o_proj"][0]
    gate_up = rms_norm(y, params["layers.mlp_norm"][0], eps) @ params["layers.gate_up_proj"][0]
    I = gate_up.shape[-1] // 2
    s = y + (jax.nn.silu(gate_up[..., :I]) * gate_up[..., I:]) @ params["layers.down_proj"][0]
    return rms_norm(s, params["final_norm"], eps) @ params["lm_head"], s
