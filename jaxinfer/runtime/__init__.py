"""The device program and what feeds it: the jitted step, parameter placement on the mesh,
and loading weights from checkpoints."""
