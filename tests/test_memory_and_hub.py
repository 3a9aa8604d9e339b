"""The KV pool sized to the device's memory, and models named by Hugging Face Hub id.

Memory: `kv_pool_pages` is the one sizing rule (the engine on its devices, `jaxinfer aot` for a
described chip: tests/test_aot.py compiles Llama-3.1-8B for a v6e through it); an explicit
`num_gpu_blocks_override` / `num_pages` or `kv_cache_memory_bytes` wins over
`gpu_memory_utilization`; the CPU keeps a fixed pool.

Hub ids: a cache laid out exactly as `huggingface_hub` lays it (models--org--name with blobs,
refs and snapshots of symlinks; `scan_cache_dir` reads it back), `HF_HUB_OFFLINE=1`, nothing
downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import huggingface_hub
import jax
import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.build import pages_from_device_memory, place_weights
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.memory import CPU_KV_CACHE_MEMORY_BYTES, device_capacity_bytes, kv_pool_pages
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from sharding.mesh import ParallelConfig, make_mesh
from tiny_models import save_hf_model

GiB = 2**30
# test_llm_api.py's engine: the same tiny model and shapes compile to the same programs (cached).
ENGINE_ARGS = dict(max_model_len=96, page_size=4, max_num_batched_tokens=32, max_num_seqs=8, progress=False)


# ----------------------------------------------------------------------------- the pool's size
def test_the_pool_is_what_fits_beside_weights_and_scratch_at_the_utilization():
    """Numbers in, pages out: 0.9 of 32 GiB is 28.8 GiB; 15 GiB of weights and 1 GiB of step
    scratch leave 12.8 GiB, 6553 pages of 2 MiB (one whole page short of the 6553.6)."""
    pages = kv_pool_pages(capacity_bytes=32 * GiB, utilization=0.9, weight_bytes=15 * GiB, scratch_bytes=1 * GiB,
                          page_bytes=2 << 20)
    assert pages == 6553
    assert kv_pool_pages(capacity_bytes=32 * GiB, utilization=0.5, weight_bytes=15 * GiB, scratch_bytes=1 * GiB,
                         page_bytes=2 << 20) == 0  # nothing fits: the caller says so


def test_a_device_says_its_capacity_and_the_cpu_does_not():
    class FakeDevice:
        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 1234}

    class FakeMesh:
        def __init__(self, *limits):
            self.devices = np.array([FakeDevice(x) for x in limits])

    assert device_capacity_bytes(FakeMesh(80 * GiB)) == 80 * GiB
    assert device_capacity_bytes(FakeMesh(80 * GiB, 79 * GiB)) == 79 * GiB  # the tightest device decides
    assert device_capacity_bytes(FakeMesh(None)) is None


def test_an_explicit_pool_size_wins_over_memory_and_utilization(smollm2_config):
    page = KVCache.page_bytes(smollm2_config, 16, np.float32)
    override = EngineConfig(num_gpu_blocks_override=40, kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.5)
    assert override.num_pages == 40 and override.resolved(smollm2_config).num_pages == 40
    by_bytes = EngineConfig(kv_cache_memory_bytes=100 * page + 1, gpu_memory_utilization=0.5)
    assert by_bytes.resolved(smollm2_config).num_pages == 100
    cpu = EngineConfig().resolved(smollm2_config)  # the CPU: a fixed pool, whatever the utilization
    assert cpu.num_pages == min(CPU_KV_CACHE_MEMORY_BYTES // page, cpu.max_num_seqs * (cpu.max_model_len // 16) + 1)
    with pytest.raises(ValueError, match="num_gpu_blocks_override=40 and num_pages=50"):
        EngineConfig(num_gpu_blocks_override=40, num_pages=50)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization={bad}"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=0"):
        EngineConfig(kv_cache_memory_bytes=0)


def test_the_engine_sizes_its_pool_from_a_device_memory_by_compiling_its_largest_bucket(model_dir, smollm2_config):
    """What the engine does on a TPU / GPU, run here with a capacity given (the CPU has none):
    the placed weights, the step's scratch from compiling its largest bucket over a small
    abstract pool, and the pool that fills the rest up to the utilization."""
    config = EngineConfig(model=str(model_dir), gpu_memory_utilization=0.9, **ENGINE_ARGS).resolved(smollm2_config)
    mesh = make_mesh(ParallelConfig())
    placed = place_weights(smollm2_config, config, mesh, load_params(resolve_model(str(model_dir)), smollm2_config,
                                                                     config.param_dtype, config.activation_dtype,
                                                                     progress=False), quantization=None)
    weights = sum(a.nbytes for a in jax.tree.leaves(placed.params))
    page = KVCache.page_bytes(smollm2_config, config.page_size, config.kv_dtype)
    capacity = weights + 64 * (1 << 20)  # 64 MiB beside the weights
    pages, scratch = pages_from_device_memory(config, smollm2_config, mesh, placed, capacity_bytes=capacity)
    assert 0 < scratch < 16 * (1 << 20)
    used = weights + scratch + pages * page
    assert used <= 0.9 * capacity < used + page
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9.*num_gpu_blocks_override"):
        pages_from_device_memory(config, smollm2_config, mesh, placed, capacity_bytes=weights)


def test_the_start_up_log_says_pages_tokens_and_sequences(hub_llm):
    """vLLM's line: page 0 is the scratch page, so 199 of the 200 pages hold tokens; a sequence
    of max_model_len 96 tokens takes 24 pages of 4."""
    assert hub_llm.engine_config.num_pages == 200
    assert hub_llm.engine.kv_cache_summary == ("KV cache: 199 pages x 4 tokens = 796 tokens; max concurrency at "
                                               "max_model_len 96: 8 sequences (num_gpu_blocks_override)")


# ----------------------------------------------------------------------------- Hub ids
def add_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """`folder`'s files as huggingface_hub caches a snapshot: blobs named by their hash,
    snapshots/<commit>/<file> symlinks to them, refs/<branch> holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


MAIN, V2, GGUF_COMMIT = "a" * 40, "b" * 40, "c" * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-smollm2")
    save_hf_model("smollm2", directory)
    return directory


@pytest.fixture(scope="module")
def smollm2_config(model_dir):
    return read_config(resolve_model(str(model_dir)))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, model_dir):
    """A Hugging Face cache holding org/tiny at two revisions (main; v2, another random model with
    a longer context) and org/tiny-gguf (a GGUF file, no config.json); HF_HUB_OFFLINE=1."""
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    add_snapshot(cache, "org/tiny", model_dir, MAIN, ("main",))
    other = root / "v2"
    other.mkdir()
    save_hf_model("smollm2", other, seed=1, max_position_embeddings=512)
    add_snapshot(cache, "org/tiny", other, V2, ("v2",))
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    w = GGUFWriter(gguf_dir / "tiny.Q8_0.gguf", "llama")
    for add, value in ((w.add_block_count, 2), (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_context_length, 4096),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, 32)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    add_snapshot(cache, "org/tiny-gguf", gguf_dir, GGUF_COMMIT, ("main",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(root))
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        # huggingface_hub reads these variables when it is imported (transformers imported it already)
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield cache


def test_the_cache_is_laid_out_as_huggingface_hub_lays_it(hub_cache):
    repos = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(hub_cache).repos}
    assert set(repos) == {"org/tiny", "org/tiny-gguf"}
    assert {rev.commit_hash: set(rev.refs) for rev in repos["org/tiny"].revisions} == {MAIN: {"main"}, V2: {"v2"}}


@pytest.fixture(scope="module")
def hub_llm(hub_cache):
    return LLM("org/tiny", num_gpu_blocks_override=200, **ENGINE_ARGS)


def test_a_hub_id_loads_from_the_cache_offline(hub_llm, hub_cache, model_dir):
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / MAIN
    assert hub_llm.source.path == snapshot and hub_llm.source.name == "org/tiny"
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = hub_llm.get_tokenizer().encode("the paged cache")
    out = hub_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    tokens = list(ids)
    for token in out.outputs[0].token_ids:  # greedy: the transformers model's argmax, token by token
        with torch.no_grad():
            assert token == int(hf(torch.tensor([tokens])).logits[0, -1].argmax())
        tokens.append(token)


def test_revision_picks_another_snapshot(hub_cache, tmp_path):
    assert read_config(resolve_model("org/tiny")).max_position_embeddings == 256
    assert read_config(resolve_model("org/tiny", revision="v2")).max_position_embeddings == 512
    assert resolve_model("org/tiny", revision=V2).path.name == V2  # a commit hash works too
    from jaxinfer.cli import main

    assert main(["convert", "org/tiny", str(tmp_path / "out"), "--revision", "v2"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 512


def test_an_unknown_hub_id_or_revision_is_an_error_naming_it(hub_cache, capsys):
    with pytest.raises(FileNotFoundError, match=r"'org/missing'.*Hugging Face"):
        LLM("org/missing", **ENGINE_ARGS)
    with pytest.raises(FileNotFoundError, match=r"'org/tiny'.*revision 'v3'"):
        resolve_model("org/tiny", revision="v3")
    from jaxinfer.cli import main

    assert main(["generate", "hello", "--model", "org/tiny", "--revision", "nope"]) == 1
    err = capsys.readouterr().err
    assert "'org/tiny'" in err and "revision 'nope'" in err


def test_a_gguf_repository_needs_its_file_named(hub_cache):
    source = resolve_model("org/tiny-gguf:tiny.Q8_0.gguf")
    assert source.kind == "gguf" and source.path.name == "tiny.Q8_0.gguf" and source.name == "org/tiny-gguf:tiny.Q8_0.gguf"
    assert read_config(source).hidden_size == 64
    with pytest.raises(ValueError, match=r"'org/tiny-gguf'.*no config.json.*org/tiny-gguf:<file>.gguf"):
        resolve_model("org/tiny-gguf")
    with pytest.raises(FileNotFoundError, match=r"'org/tiny-gguf'.*other.gguf"):
        resolve_model("org/tiny-gguf:other.gguf")


def test_a_revision_with_a_local_path_is_refused(model_dir):
    with pytest.raises(ValueError, match="revision='v2'.*Hub"):
        resolve_model(str(model_dir), revision="v2")
