"""KV tiers: evicted prefix pages kept in host memory and on disk, loaded back on a prefix hit,
never changing what a request generates."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.block_manager import BlockManager, OutOfPagesError, page_key
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.kv_tiers import DiskTier, HostTier, KVTiers, PageLayout, decode_page, encode_page
from jaxinfer.config import ModelConfig
from jaxinfer.server.metrics import ServerMetrics
from tiny_models import FAMILIES, save_hf_model

LAYOUT = PageLayout((("k", (2, 4, 1, 16), np.dtype(np.float32)), ("v", (2, 4, 1, 16), np.dtype(np.float32))))
FP = "ab" * 32  # a model fingerprint


def page(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape, dtype in LAYOUT.arrays}


def key(i: int) -> bytes:
    return page_key(b"", [i] * 4)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------------- host tier
def test_host_tier_is_an_lru_bounded_by_bytes():
    host = HostTier(3 * LAYOUT.nbytes)
    for i in range(3):
        host.put(key(i), page(i))
    assert host.get(key(0)) is not None  # 0 becomes the most recently used
    host.put(key(3), page(3))  # evicts 1, the least recently used
    assert key(1) not in host and all(key(i) in host for i in (0, 2, 3))
    assert len(host) == 3 and host.num_bytes == 3 * LAYOUT.nbytes and host.evictions == 1
    assert same(host.get(key(2)), page(2)) and host.get(key(1)) is None
    HostTier(LAYOUT.nbytes // 2).put(key(0), page(0))  # a page larger than the tier is not kept (no error)


# ---------------------------------------------------------------------- disk tier
def test_page_file_round_trip_and_a_restart_reads_the_directory(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, FP)
    for i in range(3):
        disk.put(key(i), page(i))
    assert key(0) in disk  # queued pages count as present (and are read from the queue)
    disk.close()
    # one file per page, named by its key, in the model's own subdirectory
    assert disk.directory == tmp_path / FP[:16] and sorted(os.listdir(disk.directory)) == sorted(key(i).hex() for i in range(3))
    data = (disk.directory / key(1).hex()).read_bytes()
    assert data[:8] == b"JXKVPAGE" and json.loads(data[16 : 16 + int.from_bytes(data[12:16], "little")])["key"] == key(1).hex()
    again = DiskTier(tmp_path, LAYOUT, FP)  # a new process: the index comes from the directory
    assert len(again) == 3 and all(same(again.get(key(i)), page(i)) for i in range(3))
    assert again.get(key(9)) is None
    again.close()


def test_corrupt_truncated_and_foreign_files_are_misses_logged_once(tmp_path, caplog):
    disk = DiskTier(tmp_path, LAYOUT, FP)
    for i in range(6):
        disk.put(key(i), page(i))
    disk.flush()
    path = lambda i: disk.directory / key(i).hex()  # noqa: E731
    data = bytearray(path(0).read_bytes())
    data[200] ^= 1
    path(0).write_bytes(bytes(data))  # a flipped bit: checksum
    path(1).write_bytes(path(1).read_bytes()[:100])  # truncated
    path(2).write_bytes(encode_page(key(2), "cd" * 32, LAYOUT, page(2)))  # another model's
    other = PageLayout((("k", (2, 8, 1, 16), np.dtype(np.float32)), ("v", (2, 8, 1, 16), np.dtype(np.float32))))
    path(3).write_bytes(encode_page(key(3), FP, other, {n: np.zeros(s, d) for n, s, d in other.arrays}))  # another page size
    path(4).write_bytes(path(5).read_bytes())  # another key's page under this name
    path(6).write_bytes(b"not a page at all" * 10)  # (found by the restart below)
    header = b"[]"  # a well-formed file whose header is not an object
    body = b"JXKVPAGE" + (1).to_bytes(4, "little") + len(header).to_bytes(4, "little") + header + bytes(LAYOUT.nbytes)
    (disk.directory / key(8).hex()).write_bytes(body + hashlib.sha256(body).digest())  # (found by the restart too)
    (disk.directory / f".{key(7).hex()}.123.tmp").write_bytes(b"half written")  # (a crashed writer's: the restart deletes it)
    with caplog.at_level(logging.DEBUG, logger="jaxinfer"):
        assert all(disk.get(key(i)) is None for i in range(5))
        assert same(disk.get(key(5)), page(5))
    warnings = [r.args[1] for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warnings) == ["corrupt", "foreign", "truncated"]  # each kind warned once, then at debug level
    assert disk.bad_files == 5 and all(key(i) not in disk for i in range(5))  # dropped: never read again
    restarted = DiskTier(tmp_path, LAYOUT, FP)
    assert restarted.get(key(6)) is None and restarted.get(key(0)) is None and restarted.get(key(8)) is None
    assert not any(name.endswith(".tmp") for name in os.listdir(disk.directory))
    restarted.close()
    other_model = DiskTier(tmp_path, LAYOUT, "ef" * 32)  # another model sharing the directory sees none of these
    assert len(other_model) == 0 and other_model.get(key(5)) is None
    other_model.close()
    disk.put(key(0), page(0))  # a later write of the key replaces the bad file
    disk.close()
    again = DiskTier(tmp_path, LAYOUT, FP)
    assert same(again.get(key(0)), page(0))
    again.close()
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ValueError, match="kv_offloading_dir="):
        DiskTier(tmp_path / "a-file" / "pages", LAYOUT, FP)
    with pytest.raises(ValueError, match="page array 'k'"):
        encode_page(key(0), FP, other, page(0))
    with pytest.raises(Exception) as bad:
        decode_page(b"JXKVPAGE" + bytes(100), key(0), FP, LAYOUT)
    assert bad.value.kind == "foreign"  # version 0


def test_disk_tier_bound_deletes_least_recently_used_files(tmp_path):
    size = len(encode_page(key(0), FP, LAYOUT, page(0)))
    disk = DiskTier(tmp_path, LAYOUT, FP, capacity_bytes=2 * size + size // 2)
    disk.put(key(0), page(0))
    disk.put(key(1), page(1))
    disk.flush()
    assert disk.get(key(0)) is not None  # 0 becomes the most recently used
    disk.put(key(2), page(2))
    disk.close()
    assert sorted(os.listdir(disk.directory)) == sorted([key(0).hex(), key(2).hex()]) and disk.deletions == 1


# ---------------------------------------------------------------------- block manager with lower tiers
class FakeTiers:
    """What the block manager sees of KVTiers: contains / fetch, a fetch that may fail."""

    def __init__(self):
        self.pages: dict[bytes, str] = {}
        self.failing: set[bytes] = set()

    def contains(self, k):
        return k in self.pages

    def fetch(self, k):
        return None if k in self.failing or k not in self.pages else ("host", self.pages[k])


def test_block_manager_offloads_evicted_pages_and_loads_prefix_hits_from_the_tiers():
    tiers = FakeTiers()
    bm = BlockManager(num_pages=9, page_size=4, lower_tiers=tiers)
    a = list(range(100, 117))  # 4 full pages and a token
    bm.allocate("a", a)
    bm.mark_computed("a", len(a), a)
    keys = list(bm.seqs["a"].hashes)
    bm.free("a")
    bm.allocate("b", list(range(200, 232)))  # 8 pages: evicts all 4 of a's cached pages (LRU: the last first)
    assert [k for _, k in bm.evicted] == keys[::-1]
    for _, k in bm.evicted:
        tiers.pages[k] = f"content of {k.hex()}"
    bm.evicted.clear()
    bm.free("b")
    bm.check_invariants()
    assert bm.num_cached_prefix_pages(a) == 4  # the look-up sees the tiers (read-only)
    tiers.failing.add(keys[2])  # a fetch failing at commit shortens the hit
    assert bm.allocate("a2", a) == 2 * 4
    assert [(k, c) for _, k, c in bm.pending_loads] == [(k, tiers.pages[k]) for k in keys[:2]]
    assert bm.stats.host_hits == 2 and bm.seqs["a2"].hashes == keys[:2]
    bm.check_invariants()  # loaded pages registered, held, computed
    bm.pending_loads.clear()
    bm.mark_computed("a2", len(a), a)
    bm.free("a2")
    bm.check_invariants()


def test_block_manager_with_tiers_stays_atomic_when_out_of_pages():
    tiers = FakeTiers()
    bm = BlockManager(num_pages=5, page_size=4, lower_tiers=tiers)
    a = list(range(100, 117))  # 5 pages
    key_chain = []
    for i in range(4):
        key_chain.append(page_key(key_chain[-1] if key_chain else b"", a[4 * i : 4 * i + 4]))
        tiers.pages[key_chain[-1]] = "x"
    before = (list(bm._free), dict(bm._page_of_key), list(bm.ref_counts), bm.stats.host_hits)
    with pytest.raises(OutOfPagesError):
        bm.allocate("a", a)  # 5 pages, 4 usable: the tiers' hits need fresh pages too
    assert (list(bm._free), dict(bm._page_of_key), list(bm.ref_counts), bm.stats.host_hits) == before
    assert not bm.pending_loads and not bm.evicted
    with pytest.raises(ValueError, match="lower_tiers"):
        BlockManager(num_pages=5, page_size=4, windows=(None, 8), lower_tiers=tiers)


def test_settings_are_checked_by_name():
    for bad, match in ((dict(kv_offloading_dir="/tmp/x"), "give kv_offloading_size"),
                       (dict(kv_offloading_size=-1), "kv_offloading_size=-1"),
                       (dict(kv_offloading_size=True), "kv_offloading_size=True"),
                       (dict(kv_offloading_size=1, kv_offloading_disk_size=1), "needs kv_offloading_dir"),
                       (dict(kv_offloading_size=1, enable_prefix_caching=False), "enable_prefix_caching"),
                       (dict(kv_offloading_size=1, kv_offloading_dir="/tmp/x", enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    assert EngineConfig(kv_offloading_size=0).kv_offloading_size is None  # 0: off


@pytest.mark.parametrize("family, what", [("mistral", "sliding-window"), ("qwen3_next", "Gated DeltaNet")])
def test_models_whose_prefix_hits_need_more_than_full_pages_are_refused_by_name(family, what):
    config_class, kwargs = FAMILIES[family]
    model_config = ModelConfig.from_hf_dict(config_class(**kwargs).to_dict())
    with pytest.raises(ValueError, match=f"kv_offloading_size with {family}'s {what}"):
        EngineConfig(kv_offloading_size=1).resolved(model_config)


# ---------------------------------------------------------------------- the engine
BASE = dict(max_model_len=128, page_size=4, max_num_seqs=16, max_num_batched_tokens=64, progress=False)
SMALL_POOL = 24  # pages: a turn of all six conversations does not fit, so their histories are evicted
PAGE_BYTES = 2 * 2 * 4 * 1 * 16 * 4  # the tiny llama3.2: K and V, 2 layers, 4 tokens, 1 KV head of 16, float32
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv-tiers-model")
    save_hf_model("llama3.2", directory)
    return str(directory)


@pytest.fixture(scope="module")
def conversations(model_dir):
    """Six conversations of three turns, each turn's prompt its whole history and a new message,
    with a large pool's greedy replies: [(prompts, replies)] per turn."""
    llm = LLM(model_dir, num_pages=1024, **BASE)
    rng = np.random.default_rng(0)
    histories = [[int(t) for t in rng.integers(3, 250, 16)] for _ in range(6)]
    turns = []
    for _ in range(3):
        prompts = [h + [int(t) for t in rng.integers(3, 250, 6)] for h in histories]
        replies = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        turns.append((prompts, replies))
        histories = [p + r for p, r in zip(prompts, replies)]
    return turns


def run_turns(llm, turns):
    for prompts, replies in turns:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == replies
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages and not bm.pending_loads and not bm.evicted  # nothing leaked
    return llm.engine.get_stats()


def test_multi_turn_histories_beyond_the_pool_hit_the_host_tier_with_identical_outputs(model_dir, conversations):
    llm = LLM(model_dir, num_pages=SMALL_POOL, kv_offloading_size=256 * PAGE_BYTES / 2**30, **BASE)
    stats = run_turns(llm, conversations)
    assert stats.kv_offloaded_pages > 0 and stats.prefix_cache_host_hits > 0 and stats.prefix_cache_disk_hits == 0
    assert stats.prefix_cache_host_hit_rate > stats.prefix_cache_hit_rate  # the device alone keeps few histories
    scraped = ServerMetrics(llm.engine).render().decode()
    assert f"jaxinfer:prefix_cache_host_hits_total {float(stats.prefix_cache_host_hits)}" in scraped
    assert "jaxinfer:prefix_cache_disk_hit_rate 0.0" in scraped
    without = LLM(model_dir, num_pages=SMALL_POOL, **BASE)  # the same pool without tiers computes more
    for prompts, _ in conversations:
        without.generate(prompts, PARAMS, use_tqdm=False)
    assert stats.num_prompt_tokens_computed < without.engine.get_stats().num_prompt_tokens_computed


@pytest.fixture(scope="module")
def disk_run(model_dir, conversations, tmp_path_factory):
    """The conversations on a small pool with a host tier of 8 pages and a disk tier: (stats, directory)."""
    directory = tmp_path_factory.mktemp("kv-pages")
    llm = LLM(model_dir, num_pages=SMALL_POOL, kv_offloading_size=8 * PAGE_BYTES / 2**30, kv_offloading_dir=str(directory),
              **BASE)
    stats = run_turns(llm, conversations)
    llm.close()  # the pages still cached on the device too
    return stats, directory


def test_pages_evicted_from_a_small_host_tier_hit_the_disk_tier_with_identical_outputs(disk_run, conversations):
    stats, directory = disk_run
    assert stats.prefix_cache_disk_hits > 0
    # every full page of the last turn's prompts is on disk: written through when evicted, or by close()
    (model_files,) = [d for d in directory.iterdir() if d.is_dir()]  # (the model's own subdirectory)
    assert len(os.listdir(model_files)) >= sum((len(p) - 1) // 4 for p in conversations[-1][0])


def test_a_new_process_hits_the_disk_tier_with_identical_outputs(model_dir, conversations, disk_run):
    _, directory = disk_run
    prompts, replies = conversations[-1]
    script = textwrap.dedent(f"""
        import json
        from jaxinfer import LLM, SamplingParams
        llm = LLM({model_dir!r}, num_pages={SMALL_POOL}, kv_offloading_size={8 * PAGE_BYTES / 2**30!r},
                  kv_offloading_dir={str(directory)!r}, **{BASE!r})
        outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        s = llm.engine.get_stats()
        print(json.dumps({{"replies": [list(o.outputs[0].token_ids) for o in outs], "disk_hits": s.prefix_cache_disk_hits,
                          "queries": s.prefix_cache_queries}}))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["replies"] == replies
    # each prompt's first admission finds all its full pages on disk (the new process's device and host start empty)
    assert result["disk_hits"] >= sum((len(p) - 1) // 4 for p in prompts)


FUZZ_HITS = []


@pytest.fixture(scope="module")
def fuzz_llm(model_dir):
    return LLM(model_dir, num_pages=16, **{**BASE, "max_num_batched_tokens": 16, "max_num_seqs": 6})


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None)
@hypothesis.given(data=st.data())
def test_fuzz_arrivals_aborts_forks_and_preemption_with_tiers_leak_nothing(fuzz_llm, data):
    # a fresh engine over the same compiled runner per example; a host tier of 6 pages evicts too
    config = EngineConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=6,
                          preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])))
    tiers = KVTiers(HostTier(6 * PAGE_BYTES))
    engine = LLMEngine(config, fuzz_llm.runner, fuzz_llm.tokenizer, vocab_size=fuzz_llm.config.vocab_size, eos_token_ids=[2],
                       kv_tiers=tiers)
    bm = engine.block_manager
    prefixes = [list(range(7, 15)), list(range(30, 42)), list(range(50, 54))]  # shared by many requests: prefix hits
    live: list[str] = []
    for step in range(data.draw(st.integers(20, 80))):
        action = data.draw(st.sampled_from(["add", "add", "abort", "step", "step", "step"]))
        if action == "add":
            rid = f"r{step}"
            tail = data.draw(st.lists(st.integers(3, 250), min_size=0, max_size=16))
            params = SamplingParams(n=data.draw(st.integers(1, 3)), temperature=data.draw(st.sampled_from([0.0, 1.0])),
                                    seed=step, max_tokens=data.draw(st.integers(1, 10)), ignore_eos=True)
            engine.add_request(rid, data.draw(st.sampled_from(prefixes)) + tail, params)
            live.append(rid)
        elif action == "abort" and live:
            engine.abort_request(live.pop(data.draw(st.integers(0, len(live) - 1))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        bm.check_invariants()
        assert not bm.pending_loads and not bm.evicted  # each step wrote and read them before launching
    while engine.has_unfinished_requests():
        engine.step()
        bm.check_invariants()
    assert not bm.seqs and bm.num_free_pages == bm.num_usable_pages  # nothing leaked, nothing still owned
    assert tiers.host.num_bytes <= tiers.host.capacity_bytes
    FUZZ_HITS.append(bm.stats.host_hits)


def test_fuzz_with_tiers_loaded_pages_back():
    """Runs after the fuzz above (same module): its pages really went down a tier and came back."""
    if not FUZZ_HITS:
        pytest.skip("run together with the fuzz test")
    assert sum(FUZZ_HITS) > 0
