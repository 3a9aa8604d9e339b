"""Compiling jaxinfer for TPUs and GPUs that are not here: see docs/aot.md.

- `targets`: a described TPU slice (libtpu) or NVIDIA GPU (CUDA plugin + target description);
- `kernel_check`: every Pallas kernel through the target's real compiler;
- `step_compile`: the serving step over abstract weights, pool and inputs (`AbstractStep`);
- `plan`: `jaxinfer aot`, every bucket compiled, HBM per chip and a decode estimate;
- `presets`: architectures by name.
"""
