"""One process of the two-process run in tests/test_multihost.py (started by
scripts/launch_multihost.py, which sets the JAXINFER_* environment and 4 CPU devices each).

It joins the run, then on the global mesh of 8 devices: loads the tiny model with tp = 8 (each
process reading only its devices' slices of the safetensors), runs the sharded scenario
(mesh_model.run_scenario), and generates greedily through `LLM` with dp = 2 x tp = 4. Process 0
writes the logits and tokens; every process writes how many checkpoint bytes it read.

    python tests/multihost_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mesh_model
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from sharding.mesh import ParallelConfig, initialize_distributed  # noqa: E402

initialize_distributed(timeout_s=60)  # from JAXINFER_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID

import jax  # noqa: E402

import checkpoints_conv.hf  # noqa: E402
from jaxinfer import LLM, SamplingParams  # noqa: E402
from mesh_model import MeshModel, run_scenario  # noqa: E402

model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
process = jax.process_index()
assert jax.process_count() == 2 and len(jax.local_devices()) == 4 and len(jax.devices()) == 8

bytes_read = 0
original_read = checkpoints_conv.hf.SafetensorsSource.read


def counting_read(self, name, index=None):
    global bytes_read
    array = original_read(self, name, index)
    bytes_read += array.nbytes
    return array


checkpoints_conv.hf.SafetensorsSource.read = counting_read
model = MeshModel(model_dir, ParallelConfig(tp=8))
(out_dir / f"bytes_read_{process}.json").write_text(json.dumps(bytes_read))
logits = run_scenario(model)
pipeline_logits = run_scenario(MeshModel(model_dir, ParallelConfig(pp=2, tp=4)))

llm = LLM(str(model_dir), data_parallel_size=2, tensor_parallel_size=4, max_model_len=96, page_size=4, num_pages=64,
          max_num_seqs=8, max_num_batched_tokens=64, progress=False)
prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, 6)] for i in range(4)]  # one prefill step, then decodes
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
if process == 0:
    np.savez(out_dir / "logits.npz", *logits)
    np.savez(out_dir / "pipeline_logits.npz", *pipeline_logits)
    (out_dir / "tokens.json").write_text(json.dumps([o.outputs[0].token_ids for o in outputs]))
jax.distributed.shutdown()
print(f"process {process}: done")
