"""A real two-process run on one machine: `jax.distributed` over loopback, 4 CPU devices per
process, one global mesh of 8. The sharded model gives the logits of the one-process run, `LLM`
generates the same tokens, and each process reads only its slices of the checkpoint. The
processes are started by scripts/launch_multihost.py, which stops them all on a failure or a
timeout, so the test cannot hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from mesh_model import SHAPES, MeshModel, assert_same_logits, run_scenario
from sharding.mesh import ParallelConfig
from tiny_models import save_hf_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from launch_multihost import launch  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihost-model")
    save_hf_model("llama2", directory, **SHAPES)
    return directory


def test_two_processes_on_one_global_mesh_match_one_process(model_dir, tmp_path):
    status = launch([sys.executable, str(ROOT / "tests" / "multihost_worker.py"), str(model_dir), str(tmp_path)],
                    num_processes=2, cpu_devices=4, timeout=300)
    assert status == 0

    saved = np.load(tmp_path / "logits.npz")
    assert_same_logits([saved[f"arr_{i}"] for i in range(len(saved.files))], run_scenario(MeshModel(model_dir, ParallelConfig())))

    llm = LLM(str(model_dir), max_model_len=96, page_size=4, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64, progress=False)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, 6)] for i in range(4)]  # one prefill step, then decodes
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    assert json.loads((tmp_path / "tokens.json").read_text()) == want

    # tp = 8 over two processes: each holds half of every split parameter and reads only that half
    checkpoint_bytes = (model_dir / "model.safetensors").stat().st_size
    for process in (0, 1):
        read = json.loads((tmp_path / f"bytes_read_{process}.json").read_text())
        assert 0.4 * checkpoint_bytes < read < 0.65 * checkpoint_bytes


def test_a_failing_process_stops_the_others_quickly(tmp_path):
    """One process exits with an error while the other would wait for it forever: the launcher
    stops the survivor and reports the failure."""
    code = ("import os, sys, time\n"
            "if os.environ['JAXINFER_PROCESS_ID'] == '1': sys.exit(3)\n"
            "time.sleep(60)\n")
    import time

    start = time.monotonic()
    assert launch([sys.executable, "-c", code], num_processes=2, timeout=30) == 3
    assert time.monotonic() - start < 10
