"""Views of a checkpoint's tensors: the fused or stacked tensors some architectures store, shown
as the per-part tensors the name maps know, read slice by slice.

Phi-3 fuses q, k and v into `self_attn.qkv_proj` and gate and up into `mlp.gate_up_proj`: each
reads as its Llama parts (row ranges).

GPT-OSS stores each layer's experts as one tensor, gate and up *interleaved* on the last axis:

    mlp.experts.gate_up_proj       [E, H, 2I]  (columns 0, 2, 4, ... gate; 1, 3, 5, ... up)
    mlp.experts.gate_up_proj_bias  [E, 2I]
    mlp.experts.down_proj          [E, I, H]   ([in, out], unlike a linear layer's weight)
    mlp.experts.down_proj_bias     [E, H]

or, as released, in MXFP4: `<name>_blocks` [E, out, in / 32, 16] uint8 (two 4-bit E2M1 values a
byte, low nibble first) and `<name>_scales` [E, out, in / 32] uint8 (a power of two per 32 values,
E8M0 with bias 127). Here each expert `e` reads as `mlp.experts.{e}.gate_proj.weight` [I, H],
`up_proj`, `down_proj` [H, I] and their biases: the HF [out, in] layout of a per-expert linear,
like Mixtral's. An MXFP4 weight is dequantized when read as floats, exactly as transformers'
`convert_moe_packed_tensors` does (the values are E2M1 times a power of two: exact in float32
and bfloat16), so the loaded experts equal the reference's bit for bit. The same views are
listed as quantized (`quantized()`, `read_grid`: an mxfp4 Grid of the E2M1 codes and exponent
bytes as stored, gate and up the even and odd output rows), so a loader that runs MXFP4 experts
(the TPU and GPU kernels) keeps them 4-bit.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from checkpoints_conv.quantized import FP4_VALUES, Grid, QuantLayout
from checkpoints_conv.tensor_source import TensorSource

MXFP4 = QuantLayout(bits=4, group_size=32, has_offsets=False, scale_dtype=np.dtype(np.uint8), fp4=True)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> float32 [..., G * 32]."""
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


View = tuple[tuple[int, ...], Callable[[], np.ndarray]]  # (shape, read the whole view)


class ViewSource(TensorSource):
    """`inner`'s tensors, with each stored tensor that `views` replaces shown as its views."""

    def __init__(self, inner: TensorSource, views: dict[str, View], replaced: set[str], renamed: dict[str, str] | None = None,
                 grids: dict[str, tuple[QuantLayout, Callable[[], Grid]]] | None = None):
        self.inner, self.views, self.replaced = inner, views, replaced
        self.renamed = renamed or {}  # view name -> stored name: the same tensor, read slice by slice
        self.grids = grids or {}  # view name -> read it as stored quantized (GPT-OSS's MXFP4 experts)

    def listing(self):
        shapes = dict(self.inner.listing())
        kept = [(name, shape) for name, shape in self.inner.listing() if name not in self.replaced]
        return (kept + [(name, shape) for name, (shape, _) in self.views.items()]
                + [(name, shapes[stored]) for name, stored in self.renamed.items()])

    def read(self, name, index=None):
        if name in self.renamed:
            return self.inner.read(self.renamed[name], index)
        if name not in self.views:
            return self.inner.read(name, index)
        array = self.views[name][1]()
        return array if index is None else array[tuple(index)]

    def quantized(self):
        stored = self.inner.quantized()
        kept = {name: layout for name, layout in stored.items() if name not in self.replaced}
        renamed = {name: stored[old] for name, old in self.renamed.items() if old in stored}
        return {**kept, **renamed, **{name: layout for name, (layout, _) in self.grids.items()}}

    def read_grid(self, name):
        if name in self.grids:
            return self.grids[name][1]()
        return self.inner.read_grid(self.renamed.get(name, name))

    def input_order(self, name):
        return self.inner.input_order(self.renamed.get(name, name))

    def close(self):
        self.inner.close()


_GPT_OSS_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def gpt_oss_views(source: TensorSource) -> TensorSource:
    """GPT-OSS's stacked (maybe MXFP4) expert tensors as per-expert ones (module docstring)."""
    shapes = dict(source.listing())
    views: dict[str, View] = {}
    grids: dict[str, tuple[QuantLayout, Callable[[], Grid]]] = {}
    replaced = set()
    last = {}  # the last expert matrix read: its gate and up views share one read (and one dequantization)
    for name, shape in shapes.items():
        m = _GPT_OSS_EXPERTS.fullmatch(name)
        if m is None or m.group(3) == "_scales":
            continue
        prefix, proj, suffix = m.group(1), m.group(2), m.group(3) or ""
        replaced.add(name)
        if suffix == "_blocks":
            replaced.add(f"{prefix}.{proj}_scales")
        num_experts = shape[0]
        for e in range(num_experts):
            views.update(_expert_views(source, name, prefix, proj, suffix, e, shape, last))
            if suffix == "_blocks":
                grids.update(_expert_grids(source, name, prefix, proj, e, last))
    return source if not views else ViewSource(source, views, replaced, grids=grids)


def _expert_views(source, name, prefix, proj, suffix, e, shape, last: dict) -> dict[str, View]:
    """The views of expert e of one stored tensor `name` (shape `shape`); `last` keeps the one
    expert matrix read most recently."""
    one = (slice(e, e + 1),)

    def read():  # expert e's matrix in HF [out, in] layout: [2I, H] for gate_up, [H, I] for down
        if suffix == "_blocks":
            blocks = source.read(name, one)[0]
            scales = source.read(f"{prefix}.{proj}_scales", one)[0]
            return dequantize_mxfp4(blocks, scales)
        return source.read(name, one)[0].T  # stored [in, out]

    def weight():
        if last.get("key") != (name, e):
            last.update(key=(name, e), array=read())
        return last["array"]

    out = f"{prefix}.{e}"
    if proj == "down_proj":
        if suffix == "_bias":
            return {f"{out}.down_proj.bias": ((shape[1],), lambda: source.read(name, one)[0])}
        rows = shape[2] if suffix != "_blocks" else shape[1]  # H
        cols = shape[1] if suffix != "_blocks" else shape[2] * shape[3] * 2  # I
        return {f"{out}.down_proj.weight": ((rows, cols), weight)}
    if suffix == "_bias":
        width = shape[1] // 2
        return {f"{out}.gate_proj.bias": ((width,), lambda: source.read(name, one)[0][0::2]),
                f"{out}.up_proj.bias": ((width,), lambda: source.read(name, one)[0][1::2])}
    two_i = shape[2] if suffix != "_blocks" else shape[1]
    hidden = shape[1] if suffix != "_blocks" else shape[2] * shape[3] * 2
    return {f"{out}.gate_proj.weight": ((two_i // 2, hidden), lambda: weight()[0::2]),
            f"{out}.up_proj.weight": ((two_i // 2, hidden), lambda: weight()[1::2])}


def _expert_grids(source, name, prefix, proj, e, last: dict) -> dict[str, tuple[QuantLayout, Callable[[], Grid]]]:
    """Expert e's MXFP4 weight views as stored: Grids of E2M1 codes [out, in] and exponent bytes
    [out, in / 32] (gate and up: the even and odd rows of gate_up)."""
    one = (slice(e, e + 1),)

    def codes_and_scales():
        if last.get("key") != (name, e, "grid"):
            blocks = source.read(name, one)[0]                                  # [out, in / 32, 16]
            codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[0], -1)  # low nibble first
            last.update(key=(name, e, "grid"), array=(codes, source.read(f"{prefix}.{proj}_scales", one)[0]))
        return last["array"]

    def grid(rows: slice):
        return lambda: Grid(*(a[rows] for a in codes_and_scales()), None, MXFP4)

    out = f"{prefix}.{e}"
    if proj == "down_proj":
        return {f"{out}.down_proj.weight": (MXFP4, grid(slice(None)))}
    return {f"{out}.gate_proj.weight": (MXFP4, grid(slice(0, None, 2))), f"{out}.up_proj.weight": (MXFP4, grid(slice(1, None, 2)))}


_PHI3_FUSED = re.compile(r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


def phi3_views(source: TensorSource, config: dict) -> TensorSource:
    """Phi-3's fused qkv_proj [(Hq + 2 Hkv) D, H] and gate_up_proj [2I, H] as the q/k/v and
    gate/up linears of a Llama layer (row ranges of the stored tensor, read as slices)."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    parts = {"self_attn.qkv_proj": (("self_attn.q_proj", heads * head_dim), ("self_attn.k_proj", kv_heads * head_dim),
                                    ("self_attn.v_proj", kv_heads * head_dim)),
             "mlp.gate_up_proj": (("mlp.gate_proj", config["intermediate_size"]), ("mlp.up_proj", config["intermediate_size"]))}
    views: dict[str, View] = {}
    replaced = set()
    for name, shape in source.listing():
        m = _PHI3_FUSED.fullmatch(name)
        if m is None:
            continue
        replaced.add(name)
        start = 0
        for part, rows in parts[m.group(2)]:
            one = slice(start, start + rows)
            views[f"{m.group(1)}.{part}.weight"] = ((rows, shape[1]), lambda name=name, one=one: source.read(name, (one,)))
            start += rows
    return source if not views else ViewSource(source, views, replaced)


_GEMMA3_OLD_NAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def gemma3_views(source: TensorSource, config: dict) -> TensorSource:
    """Gemma 3 multimodal exports that name the text decoder language_model.model.* (the released
    checkpoints) read under transformers 5's names (model.language_model.*)."""
    renamed = {}
    for name, _ in source.listing():
        for old, new in _GEMMA3_OLD_NAMES:
            if name.startswith(old):
                renamed[new + name[len(old):]] = name
                break
    return source if not renamed else ViewSource(source, {}, set(renamed.values()), renamed)


def qwen2_5_vl_views(source: TensorSource, config: dict) -> TensorSource:
    """Qwen2.5-VL (and Qwen3-VL) folders that name the text decoder model.language_model.* (transformers
    5's module names) read under the names transformers saves (model.*); the vision tower is left as it is."""
    renamed = {"model." + name[len("model.language_model."):]: name
               for name, _ in source.listing() if name.startswith("model.language_model.")}
    return source if not renamed else ViewSource(source, {}, set(renamed.values()), renamed)


_GLM4_MOE_MLP = re.compile(r"model\.layers\.(\d+)\.(mlp\.(?:gate|experts|shared_experts)\..+)")
_LAYER = re.compile(r"model\.layers\.(\d+)\..+")


def glm4_moe_views(source: TensorSource, config: dict) -> TensorSource:
    """GLM-4.5's MoE layers begin at layer k = first_k_dense_replace, and their stacks at slot 0:
    layer i's router and experts read as layer i - k's (the name map's slots). The layers past
    num_hidden_layers (the multi-token-prediction module, not run here) are left out."""
    k, num_layers = int(config.get("first_k_dense_replace", 0)), int(config["num_hidden_layers"])
    renamed, hidden = {}, set()
    for name, _ in source.listing():
        layer = _LAYER.fullmatch(name)
        if layer and int(layer.group(1)) >= num_layers:
            hidden.add(name)
            continue
        m = _GLM4_MOE_MLP.fullmatch(name)
        if m and k:
            renamed[f"model.layers.{int(m.group(1)) - k}.{m.group(2)}"] = name
            hidden.add(name)
    return source if not hidden else ViewSource(source, {}, hidden, renamed)


_LLAMA4_OLD_NAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."))
_LLAMA4_QK = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_proj\.weight")
_LLAMA4_MLP = re.compile(r"model\.layers\.(\d+)\.feed_forward\.(.+)")
_LLAMA4_EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)")


# The model_types whose q/k rows llama4_views reorders (whatever else reads those rows must follow)
QK_ROWS_REORDERED = ("llama4_text", "llama4")


def pairs_to_halves(head_dim: int) -> np.ndarray:
    """Within one head, the row order that turns RoPE's adjacent pairs (0, 1), (2, 3), ... into
    halves (0, D/2), (1, D/2 + 1), ...: Llama 4's q and k rows (and a LoRA adapter's) at load."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def llama4_views(source: TensorSource, config: dict) -> TensorSource:
    """Llama 4's tensors as the name map reads them:

    - a multimodal folder's text decoder (language_model.model.* and language_model.lm_head.*, or
      model.language_model.*) under the text model's names (model.*, lm_head.*); its vision tower
      is skipped by the name map;
    - each head's rows of q_proj and k_proj reordered from RoPE pairs (0, 1), (2, 3), ... to
      halves (0, D/2), (1, D/2 + 1), ...: Llama 4 turns adjacent dims, the kernels turn halves,
      and reordering q's and k's dims alike changes no score;
    - the experts, stored [E, H, 2I] (gate | up) and [E, I, H] as [in, out], as per-expert
      linears `feed_forward.experts.{e}.{gate,up,down}_proj.weight` in HF's [out, in];
    - a MoE layer's MLP tensors under the MoE layers' own numbering, a dense layer's under the dense
      ones' (the stacks hold their kind of layer only: param_layout.stack_slots)."""
    text = config.get("text_config") or config
    num_layers, step = int(text["num_hidden_layers"]), int(text.get("interleave_moe_layer_step", 1))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    halves = pairs_to_halves(head_dim)
    moe_slot = {layer: slot for slot, layer in enumerate(range(step - 1, num_layers, step))}
    dense_slot = {layer: slot for slot, layer in enumerate(i for i in range(num_layers) if i not in moe_slot)}
    stored = {}  # the text model's name -> the stored name
    for name, _ in source.listing():
        new = next((new + name[len(old):] for old, new in _LLAMA4_OLD_NAMES if name.startswith(old)), name)
        stored[new] = name
    shapes = dict(source.listing())
    views: dict[str, View] = {}
    renamed = {}
    for name, inner in stored.items():
        shape = shapes[inner]
        if _LLAMA4_QK.fullmatch(name):
            def read(inner=inner, shape=shape):
                rows = source.read(inner)
                return rows.reshape(-1, head_dim, shape[1])[:, halves].reshape(shape)
            views[name] = (tuple(shape), read)
            continue
        m = _LLAMA4_MLP.fullmatch(name)
        if m is None:
            if name != inner:
                renamed[name] = inner
            continue
        layer, rest = int(m.group(1)), m.group(2)
        slot = moe_slot[layer] if layer in moe_slot else dense_slot[layer]
        prefix = f"model.layers.{slot}.feed_forward"
        e = _LLAMA4_EXPERTS.fullmatch(rest)
        if e is None:
            renamed[f"{prefix}.{rest}"] = inner
            continue
        for expert in range(shape[0]):
            one = (slice(expert, expert + 1),)
            if e.group(1) == "down_proj":  # [E, I, H]: expert's [H, I]
                views[f"{prefix}.experts.{expert}.down_proj.weight"] = (
                    (shape[2], shape[1]), lambda inner=inner, one=one: source.read(inner, one)[0].T)
            else:  # [E, H, 2I]: gate the first half of the columns, up the second
                width = shape[2] // 2
                for part, cols in (("gate_proj", slice(0, width)), ("up_proj", slice(width, 2 * width))):
                    views[f"{prefix}.experts.{expert}.{part}.weight"] = (
                        (width, shape[1]), lambda inner=inner, one=one, cols=cols: source.read(inner, one)[0][:, cols].T)
    hidden = set(renamed.values()) | {stored[name] for name in views if name in stored} | {
        inner for name, inner in stored.items() if _LLAMA4_MLP.fullmatch(name)}
    return ViewSource(source, views, hidden, renamed)


_GEMMA4_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|experts)\.(.+)")


def gemma4_layer_plan(text: dict) -> tuple[list[str], int, bool]:
    """(layer_types, num_kv_shared_layers, whether the shared layers' MLP is double-wide) of a
    Gemma 4 text config, as transformers settles them (the last layer always full attention)."""
    n = int(text["num_hidden_layers"])
    types = list(text.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"
    shared = int(text.get("num_kv_shared_layers") or 0)
    return types, shared, bool(text.get("use_double_wide_mlp")) and shared > 0


def gemma4_views(source: TensorSource, config: dict) -> TensorSource:
    """Gemma 4's tensors as the name map reads them:

    - a multimodal folder's text decoder (model.language_model.*) under the text model's names;
    - the attention of the global (full-attention) layers, whose head dim and KV heads are their
      own, as `model.layers.{j}.global_attn.*` (j: its place among the global layers), the other
      layers' as `model.layers.{j}.self_attn.*` numbered among themselves; likewise the KV-shared
      layers' double-wide MLP as `wide_mlp` (param_layout.stack_of);
    - a KV-shared layer's key and value projections and key norm, which it does not have (it reads
      the K/V of the last earlier layer of its kind), as zeros shaped as that layer's: never read;
    - the experts, stored [E, 2I, H] (gate | up) and [E, H, I], as per-expert linears."""
    text = config.get("text_config") or config
    types, shared, wide = gemma4_layer_plan(text)
    n = len(types)
    slot = {}  # (layer, "self_attn" | "global_attn" | "mlp" | "wide_mlp") -> its number
    for where, member in (("global_attn", lambda i: types[i] == "full_attention"), ("self_attn", lambda i: types[i] != "full_attention"),
                          ("wide_mlp", lambda i: wide and i >= n - shared), ("mlp", lambda i: not (wide and i >= n - shared))):
        for j, i in enumerate(i for i in range(n) if member(i)):
            slot[(i, where)] = j
    stored = {}  # the text model's name -> the stored name
    for name, _ in source.listing():
        stored[name.replace("model.language_model.", "model.", 1) if name.startswith("model.language_model.") else name] = name
    shapes = dict(source.listing())
    views: dict[str, View] = {}
    renamed = {}
    for name, inner in stored.items():
        m = _GEMMA4_LAYER.fullmatch(name)
        if m is None:
            if name != inner:
                renamed[name] = inner
            continue
        layer, module, rest = int(m.group(1)), m.group(2), m.group(3)
        if module == "experts":
            shape = shapes[inner]
            for e in range(shape[0]):
                one = (slice(e, e + 1),)
                prefix = f"model.layers.{layer}.experts.{e}"
                if rest == "down_proj":  # [E, H, I]: HF's [out, in] already
                    views[f"{prefix}.down_proj.weight"] = ((shape[1], shape[2]), lambda inner=inner, one=one: source.read(inner, one)[0])
                else:  # gate_up_proj [E, 2I, H]: gate the first I rows, up the rest
                    width = shape[1] // 2
                    for part, rows in (("gate_proj", slice(0, width)), ("up_proj", slice(width, 2 * width))):
                        views[f"{prefix}.{part}.weight"] = (
                            (width, shape[2]), lambda inner=inner, one=one, rows=rows: source.read(inner, one)[0][rows])
            continue
        where = ("global_attn" if types[layer] == "full_attention" else "self_attn") if module == "self_attn" else (
            "wide_mlp" if wide and layer >= n - shared else "mlp")
        renamed[f"model.layers.{slot[(layer, where)]}.{where}.{rest}"] = inner
    for i in range(n - shared, n):  # the KV-shared layers' missing key / value weights: zeros
        where = "global_attn" if types[i] == "full_attention" else "self_attn"
        source_layer = max(j for j in range(n - shared) if types[j] == types[i])  # whose K/V it reads
        for part in ("k_proj.weight", "k_norm.weight", "v_proj.weight"):  # (no v_proj where values are keys)
            source_name = stored.get(f"model.layers.{source_layer}.self_attn.{part}")
            if source_name is not None:
                shape = tuple(shapes[source_name])
                views[f"model.layers.{slot[(i, where)]}.{where}.{part}"] = (shape, lambda s=shape: np.zeros(s, np.float32))
    hidden = set(renamed.values()) | {inner for name, inner in stored.items() if _GEMMA4_LAYER.fullmatch(name)}
    return ViewSource(source, views, hidden, renamed)


_QWEN3_NEXT_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|linear_attn)\.(.+)")


def hybrid_layer_types(text: dict) -> list[str]:
    """A Qwen3-Next / Qwen3.5 text config's layer types, as transformers settles them."""
    n, interval = int(text["num_hidden_layers"]), int(text.get("full_attention_interval") or 4)
    return list(text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                            for i in range(n)])


def qwen3_next_views(source: TensorSource, config: dict) -> TensorSource:
    """Qwen3-Next's and Qwen3.5's tensors as the name map reads them:

    - a multimodal Qwen3.5 folder's text decoder (model.language_model.*) under the text model's
      names; its vision tower (model.visual.*) and multi-token-prediction layers (mtp.*) hidden;
    - each full-attention layer's q_proj [Hq * 2D, H], per head [q | gate], as q_proj and gate_proj;
    - the Gated DeltaNet's q | k | v projection and the convolution over those channels ([C, 1, K]
      read as [C, K]) in their q, k and v parts (in_proj_q / _k / _v, conv1d_q / _k / _v), Qwen3-Next's
      fused projections, grouped per key head g ([q_g | k_g | v_g | z_g] and [b_g | a_g], g's value
      heads together), likewise, its z, b and a as Qwen3.5's in_proj_z, in_proj_b and in_proj_a;
    - the full-attention layers' tensors numbered among themselves, likewise the linear ones'
      (param_layout.stack_of: each kind's weights stack over its own layers)."""
    text = config.get("text_config") or config
    types = hybrid_layer_types(text)
    ordinal = {}
    for kind in ("full_attention", "linear_attention"):
        for j, i in enumerate(i for i, t in enumerate(types) if t == kind):
            ordinal[i] = j
    heads, head_dim = int(text["num_attention_heads"]), int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    dk, dv, r = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"]), hv // hk
    shapes = dict(source.listing())
    views: dict[str, View] = {}
    renamed, hidden = {}, set()

    def rows_view(inner: str, rows: np.ndarray) -> View:
        return (len(rows), shapes[inner][1]), lambda: source.read(inner)[rows]

    def qkv_parts(prefix: str, name: str, inner: str, q_rows, k_rows, v_rows, squeeze: bool = False) -> None:
        for part, rows in (("q", q_rows), ("k", k_rows), ("v", v_rows)):
            if squeeze:  # the convolution's [C, 1, K]
                views[f"{prefix}.{name}_{part}.weight"] = ((len(rows), shapes[inner][2]),
                                                           lambda inner=inner, rows=rows: source.read(inner)[rows, 0, :])
            else:
                views[f"{prefix}.{name}_{part}.weight"] = rows_view(inner, rows)

    kd, vd = hk * dk, hv * dv
    plain = (np.arange(kd), np.arange(kd, 2 * kd), np.arange(2 * kd, 2 * kd + vd))  # Qwen3.5's [q | k | v] rows

    group = 2 * dk + 2 * r * dv  # rows of one key head's block of in_proj_qkvz
    qkvz = {part: np.concatenate([np.arange(g * group + start, g * group + start + width) for g in range(hk)])
            for part, start, width in (("q", 0, dk), ("k", dk, dk), ("v", 2 * dk, r * dv), ("z", 2 * dk + r * dv, r * dv))}
    ba = {part: np.concatenate([np.arange(g * 2 * r + start, g * 2 * r + start + r) for g in range(hk)])
          for part, start in (("b", 0), ("a", r))}
    q_rows = np.concatenate([np.arange(2 * head_dim * h, 2 * head_dim * h + head_dim) for h in range(heads)])
    for stored, _ in source.listing():
        name = stored.replace("model.language_model.", "model.", 1)
        if name.startswith(("model.visual.", "mtp.")):
            hidden.add(stored)
            continue
        m = _QWEN3_NEXT_LAYER.fullmatch(name)
        if m is None:
            if name != stored:  # (a multimodal folder's)
                renamed[name] = stored
                hidden.add(stored)
            continue
        hidden.add(stored)
        layer, module, rest = int(m.group(1)), m.group(2), m.group(3)
        prefix = f"model.layers.{ordinal[layer]}.{module}"
        if module == "self_attn" and rest == "q_proj.weight":
            views[f"{prefix}.q_proj.weight"] = rows_view(stored, q_rows)
            views[f"{prefix}.gate_proj.weight"] = rows_view(stored, q_rows + head_dim)
        elif rest == "in_proj_qkvz.weight":
            qkv_parts(prefix, "in_proj", stored, qkvz["q"], qkvz["k"], qkvz["v"])
            views[f"{prefix}.in_proj_z.weight"] = rows_view(stored, qkvz["z"])
        elif rest == "in_proj_qkv.weight":
            qkv_parts(prefix, "in_proj", stored, *plain)
        elif rest == "in_proj_ba.weight":
            views[f"{prefix}.in_proj_b.weight"] = rows_view(stored, ba["b"])
            views[f"{prefix}.in_proj_a.weight"] = rows_view(stored, ba["a"])
        elif rest == "conv1d.weight":
            qkv_parts(prefix, "conv1d", stored, *plain, squeeze=True)
        else:
            renamed[f"{prefix}.{rest}"] = stored
    return ViewSource(source, views, hidden, renamed)


# HF model_type -> the views its checkpoints need
VIEWS = {"gpt_oss": lambda source, config: gpt_oss_views(source), "phi3": phi3_views, "gemma3": gemma3_views, "qwen2_5_vl": qwen2_5_vl_views, "qwen3_vl": qwen2_5_vl_views,
         "glm4_moe": glm4_moe_views, "deepseek_v2": glm4_moe_views, "deepseek_v3": glm4_moe_views, "deepseek_v32": glm4_moe_views, "glm_moe_dsa": glm4_moe_views, "gemma4_text": gemma4_views, "gemma4": gemma4_views, **{model_type: llama4_views for model_type in QK_ROWS_REORDERED},
         **{model_type: qwen3_next_views for model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text",
                                                            "qwen3_5_moe")}}


def mtp_views(source: TensorSource, config: dict, index: int = 0) -> TensorSource:
    """DeepSeek-V3's multi-token-prediction layer `index` (stored as layer num_hidden_layers + index)
    as the one layer of a model of its own (models.deepseek_mtp): its decoder block and its input
    norms and projection (enorm, hnorm, eh_proj) read as layer 0's, its shared_head.norm as the final
    norm. Everything else is hidden, its own embed_tokens and shared_head.head too: the module
    shares the target's embedding and LM head, as DeepSeek-V3 trains it."""
    layer = re.compile(rf"model\.layers\.{int(config['num_hidden_layers']) + index}\.(.+)")
    renamed, hidden = {}, set()
    for name, _ in source.listing():
        hidden.add(name)
        m = layer.fullmatch(name)
        if m is None or m.group(1).startswith(("embed_tokens.", "shared_head.head.")):
            continue
        renamed["model.norm.weight" if m.group(1) == "shared_head.norm.weight" else f"model.layers.0.{m.group(1)}"] = name
    return ViewSource(source, {}, hidden, renamed)


def with_views(source: TensorSource, config: dict) -> TensorSource:
    """`source` as the name maps of `config`'s model_type expect to read it (an embedding or
    classification checkpoint's names first made a decoder's: `pooling_model_views`)."""
    source = pooling_model_views(source)
    make = VIEWS.get(config.get("model_type"))
    return source if make is None else make(source, config)


BARE_MODEL_PREFIXES = ("layers.", "embed_tokens.", "norm.")  # a base model saved alone (transformers' AutoModel)
CLASSIFIER_TENSORS = ("score.weight", "score.bias")  # *ForSequenceClassification's head


def pooling_model_views(source: TensorSource) -> TensorSource:
    """An embedding or sequence-classification checkpoint as a decoder's name map reads it: a
    base model saved without its LM head (AutoModel's `layers.*`, `embed_tokens.*`, `norm.*`, as
    Qwen3-Embedding ships) under `model.*`, and a classification head (`score.*`) left out: the
    pooler reads it (jaxinfer.engine.pooling). Any other checkpoint is returned as it is."""
    names = [name for name, _ in source.listing()]
    head = {name for name in names if name in CLASSIFIER_TENSORS}
    renamed = {}
    if not any(name.startswith("model.") for name in names):
        renamed = {"model." + name: name for name in names if name.startswith(BARE_MODEL_PREFIXES)}
    if not head and not renamed:
        return source
    return ViewSource(source, {}, head | set(renamed.values()), renamed)
