"""checkpoints_conv: read HF safetensors and GGUF checkpoints into jaxinfer's parameter layout,
and save/restore converted parameters with orbax.

Knows HF config dicts and tensor names, never the engine: the caller passes the parameter spec.

    config = read_checkpoint_config(path)              # HF model dir or .gguf file
    source = open_checkpoint(path, config)             # tensors by name: listing() and read(name, slices);
                                                       # quantized() and read_grid(name) for stored grids
    params = load_params(source, spec, model_type=config["model_type"], source=str(path),
                         shardings=None)               # or {param: jax Sharding}: each device's slices only
    save_params(out_dir, nested_params); restore_params(out_dir, abstract_tree)
"""

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.gguf_io import SUPPORTED_TYPES as SUPPORTED_GGUF_TYPES
from checkpoints_conv.gguf_io import GgufSource, iter_gguf_tensors, read_gguf_config, unpermute_qk
from checkpoints_conv.hf import SafetensorsSource, iter_safetensors, read_hf_config
from checkpoints_conv.loader import load_params, plan_params, read_blocks
from checkpoints_conv.name_maps import HF_NAME_MAPS, GGUF_ARCHS, Target, arch_names, map_hf_name
from checkpoints_conv.quantized import Grid, QuantizedSource, QuantLayout, param_layouts
from checkpoints_conv.orbax_io import restore_params, save_params, saved_param_shapes
from checkpoints_conv.source import is_gguf, iter_checkpoint_tensors, open_checkpoint, read_checkpoint_config
from checkpoints_conv.tensor_source import ArraySource, TensorSource

__all__ = [
    "ArraySource",
    "CheckpointError",
    "Grid",
    "QuantLayout",
    "QuantizedSource",
    "arch_names",
    "param_layouts",
    "GgufSource",
    "SafetensorsSource",
    "TensorSource",
    "open_checkpoint",
    "plan_params",
    "read_blocks",
    "GGUF_ARCHS",
    "HF_NAME_MAPS",
    "SUPPORTED_GGUF_TYPES",
    "Target",
    "is_gguf",
    "iter_checkpoint_tensors",
    "iter_gguf_tensors",
    "iter_safetensors",
    "load_params",
    "map_hf_name",
    "read_checkpoint_config",
    "read_gguf_config",
    "read_hf_config",
    "restore_params",
    "save_params",
    "saved_param_shapes",
    "unpermute_qk",
]
