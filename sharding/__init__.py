"""Device meshes and sharding rules (data / tensor / sequence / expert parallelism).

Empty for now: the model runs on one device. The sharding issue fills this package
(mesh.py, rules.py, MoE expert dispatch, ring attention). Depends on JAX alone.
"""
