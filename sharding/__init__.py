"""Device meshes and sharding (data / tensor / sequence / expert parallelism). Depends on JAX alone.

- `mesh.py`: ParallelConfig, make_mesh over the local or global devices, checks of a model's
  dimensions against the sizes, the multi-process start (`initialize_distributed`);
- `rules.py`: logical axis names -> mesh axes -> PartitionSpecs;
- `expert_parallel.py`: the routed experts of a MoE layer, local or dispatched with all_to_all;
- `ring_attention.py`: attention partials, their log-sum-exp merge, ring attention over a mesh axis;
- `hlo.py`: the collectives of a compiled program (for tests and scripts/comm_model.py).
"""
