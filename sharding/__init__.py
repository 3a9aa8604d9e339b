"""Device meshes and sharding rules (data / tensor / sequence / expert parallelism).

So far: `mesh.py` (ParallelConfig, make_mesh over the local or global devices, checks of a model's
dimensions against the sizes, the multi-process start). Still to come: rules.py (logical axis
names -> PartitionSpec), MoE expert dispatch, ring attention. Depends on JAX alone.
"""
