"""A real two-process run on one machine: `jax.distributed` over loopback, 4 CPU devices per
process, one global mesh of 8. The sharded model gives the logits of the one-process run (with
tp = 8, and as a pipeline whose two stages are the two processes), `LLM`
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

    truth = run_scenario(MeshModel(model_dir, ParallelConfig()))
    for name in ("logits.npz", "pipeline_logits.npz"):  # tp = 8; a pipeline of two stages, one per process
        saved = np.load(tmp_path / name)
        assert_same_logits([saved[f"arr_{i}"] for i in range(len(saved.files))], truth)

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


def test_serving_on_two_processes_process_0_takes_requests_both_step(model_dir, tmp_path):
    """`jaxinfer serve -tp 2` over two processes of one device each: process 0 answers HTTP, the
    other replays its requests (jaxinfer.server.lockstep). Concurrent requests arriving at
    different moments, streamed and not, and a client hanging up mid-stream give what one process
    gives; SIGTERM to process 0 drains it and stops both, each with every page free."""
    import asyncio
    import os
    import signal
    import subprocess
    import time

    import httpx
    import openai
    from launch_multihost import free_port

    settings = ["--max-model-len", "96", "--page-size", "4", "--num-pages", "64", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "32"]
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAXINFER_COORDINATOR=coordinator, JAXINFER_NUM_PROCESSES="2",
                   JAXINFER_PROCESS_ID=str(i), JAXINFER_CACHE=str(tmp_path / "cache"),
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1".strip())
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())", "serve", str(model_dir),
             "--port", str(port), "-tp", "2", "--served-model-name", "tiny", *settings],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        # meanwhile, what one process generates (greedy: the same tokens whatever the batch)
        llm = LLM(str(model_dir), max_model_len=96, page_size=4, num_pages=64, max_num_seqs=8, max_num_batched_tokens=32,
                  progress=False)
        prompts = [f"request {i} says" for i in range(10)]
        lengths = [3 + i % 6 for i in range(10)]
        want = [o.outputs[0].text for o in llm.generate(
            prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)]

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:  # start-up: two processes compiling on the same cores, bounded
            assert all(p.poll() is None for p in procs), "a serving process exited during start-up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 180 s"
            time.sleep(0.2)

        async def clients():
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

            async def one(i):
                await asyncio.sleep(0.15 * (i % 4))  # arrivals spread over several steps
                kwargs = dict(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"ignore_eos": True})
                if i % 3:
                    return (await client.completions.create(**kwargs)).choices[0].text
                return "".join([c.choices[0].text async for c in await client.completions.create(**kwargs, stream=True)])

            async def hang_up():  # leaves mid-stream: its abort reaches both processes
                async with httpx.AsyncClient(timeout=60) as h:
                    body = {"model": "tiny", "prompt": "leave early", "max_tokens": 60, "stream": True, "ignore_eos": True}
                    async with h.stream("POST", url + "/v1/completions", json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                return

            *texts, _ = await asyncio.gather(*(one(i) for i in range(10)), hang_up())
            await client.close()
            return texts

        assert asyncio.run(clients()) == want
        procs[0].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert "unfinished requests 0, KV cache usage 0%" in outputs[1], outputs[1][-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
