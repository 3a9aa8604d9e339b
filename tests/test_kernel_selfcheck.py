"""The on-device kernel check (jaxinfer.runtime.kernel_selfcheck), here in interpret mode: a kernel
that computes wrong or cannot compile is caught, named in the log, and replaced by its XLA path,
in the table and in a served engine; verdicts are cached; what the check sees of a model."""

from __future__ import annotations

import dataclasses

import importlib.util
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.build import check_kernels_on_device
from jaxinfer.engine.config import EngineConfig
from jaxinfer.models.lora import LoraTable
from jaxinfer.ops import kernels as kernel_table
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.quantization import quantize_params
from jaxinfer.runtime.kernel_selfcheck import StepShapes, checked_kernels, run_checks, step_shapes
from jaxinfer.runtime.loading import abstract_model, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from tiny_models import save_hf_model

XLA = Kernels()
# A TPU pool is combined, where the step rotates and writes K / V in XLA (no RoPE + KV-write
# kernel); with the XLA attention's separate pools the kernel entry runs.
TINY = StepShapes(num_heads=2, num_kv_heads=1, head_dim=64, hidden=128, dtype="float32", norm_dtype="float32",
                  rms_norm_eps=1e-5, page_size=4, kv_dtype="float32")
CHECKED = ("ragged_attention", "rope_kv_write", "add_rms_norm")


def plus_one(kernel):
    """A kernel off by one everywhere (its first output, for kernels returning several)."""
    def broken(*args, **kwargs):
        out = kernel(*args, **kwargs)
        return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0
    return broken


def refused(*args, **kwargs):
    """A kernel the chip's compiler refuses."""
    raise RuntimeError("Mosaic failed to compile TPU kernel: (a kernel refused for the test)")


class Counting:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.kernel(*args, **kwargs)


def test_a_refused_kernel_and_a_wrong_one_take_their_xla_paths_and_the_verdicts_are_cached(tmp_path, caplog):
    """The TPU kernels in interpret mode, the attention refused by the compiler and the norm off
    by one: both fail, are named in the log and run their XLA paths. The attention's brings the
    separate pool layout, at which the RoPE + KV-write entry (not run with the TPU's combined
    pool) is then checked, passes and stays. A second check reads every verdict from the cache and runs nothing;
    another function in an entry is checked anew."""
    tpu = Kernels("tpu", interpret=True)
    assert run_checks(tpu, TINY, operations=["rope_kv_write"]) == []  # combined pools: the step's XLA write
    calls = {"ragged_attention": Counting(refused), "add_rms_norm": Counting(plus_one(tpu.add_rms_norm)),
             "rope_kv_write": Counting(tpu.rope_kv_write)}
    broken = Kernels("tpu", interpret=True, **calls)
    cache = tmp_path / "kernel_checks.json"
    with caplog.at_level(logging.WARNING, logger="jaxinfer"):
        checked = checked_kernels(broken, TINY, operations=CHECKED, cache=cache)

    assert checked.xla == ("add_rms_norm", "ragged_attention") and checked != tpu
    assert checked.ragged_attention is XLA.ragged_attention and checked.add_rms_norm is XLA.add_rms_norm
    assert not checked.combines_kv  # the XLA attention's pool: separate K and V
    assert checked.rope_kv_write is calls["rope_kv_write"]  # the healthy kernel stays
    log = caplog.text
    assert "kernel ragged_attention failed its on-device check (decode" in log and "RuntimeError: Mosaic failed" in log
    assert "1 more of its cases failed" in log  # the mixed step's
    assert "kernel add_rms_norm failed its on-device check (T=8 H=128" in log and "max error" in log
    assert log.count("using the XLA path") == 2 and "rope_kv_write" not in log

    verdicts = {key.rsplit(" | ", 2)[1].split()[0]: record["verdict"] for key, record in json.loads(cache.read_text()).items()}
    assert verdicts == {"ragged_attention": "FAIL", "add_rms_norm": "FAIL", "rope_kv_write": "pass"}
    assert all("cpu, tpu kernels in interpret mode" in key for key in json.loads(cache.read_text()))
    assert len(json.loads(cache.read_text())) == 5  # attention: a decode and a mixed step; norm: with and without residual

    ran = {name: c.calls for name, c in calls.items()}
    assert ran["ragged_attention"] == 2 and ran["add_rms_norm"] == 2 and ran["rope_kv_write"] == 1
    assert checked_kernels(broken, TINY, operations=CHECKED, cache=cache) == checked
    cached = run_checks(broken, TINY, operations=CHECKED, cache=cache)  # the TPU layout: no write kernel
    assert len(cached) == 4 and all(v.cached and v.failed for v in cached)
    assert {name: c.calls for name, c in calls.items()} == ran  # nothing ran again
    other = Kernels("tpu", interpret=True, add_rms_norm=plus_one(tpu.add_rms_norm))  # another function: checked anew
    assert not any(v.cached for v in run_checks(other, TINY, operations=["add_rms_norm"], cache=cache))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("selfcheck-model")
    save_hf_model("smollm2", directory)  # GQA 6:2, head_dim 16, an MLP without bias (the SwiGLU kernel's)
    return str(directory)


def test_an_engine_serves_the_xla_path_of_a_kernel_that_fails_its_check(model_dir, monkeypatch, tmp_path, caplog):
    """kernel_impl="pallas" with a table whose norm kernel is off by one and whose SwiGLU kernel
    does not compile (every other entry the XLA path): with check_kernels=True the engine runs
    the check at its model's shapes, and then serves exactly what the XLA paths serve."""
    def table(interpret):
        xla = kernel_table._xla_table(interpret)
        return dict(xla, add_rms_norm=plus_one(xla["add_rms_norm"]), swiglu_matmul=refused)

    monkeypatch.setitem(kernel_table._TABLES, "tpu", table)
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    settings = dict(max_model_len=64, page_size=4, num_pages=64, max_num_batched_tokens=32, progress=False)
    with caplog.at_level(logging.WARNING, logger="jaxinfer"):
        llm = LLM(model_dir, kernel_impl="pallas", check_kernels=True, **settings)
    assert llm.engine_config.xla_kernels == ("add_rms_norm", "swiglu_matmul") == llm.kernels.xla
    assert "kernel add_rms_norm failed its on-device check" in caplog.text
    assert "kernel swiglu_matmul failed its on-device check" in caplog.text
    assert (tmp_path / "kernel_checks.json").is_file()

    reference = LLM(model_dir, kernel_impl="reference", **settings)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 31))]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in reference.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cumulative_logprob for o in got] == [o.cumulative_logprob for o in want]


def test_the_check_runs_on_a_chip_by_default_and_in_interpret_mode_when_asked():
    """On the CPU "pallas" means interpret mode: no check unless check_kernels=True; never with
    check_kernels=False or with the XLA paths (then nothing at all is looked at)."""
    for settings in (dict(kernel_impl="pallas"), dict(kernel_impl="pallas", check_kernels=False),
                     dict(kernel_impl="reference", check_kernels=True)):
        config = EngineConfig(**settings)
        assert check_kernels_on_device(config, None, None, None, None) == (config, None)


def test_kernel_table_xla_entries_are_checked_names():
    table = Kernels("gpu", interpret=True, xla=("swiglu_matmul", "ragged_attention", "swiglu_matmul"))
    assert table.xla == ("ragged_attention", "swiglu_matmul") and table != Kernels("gpu", interpret=True)
    assert table.swiglu_matmul is XLA.swiglu_matmul and table.add_rms_norm is not XLA.add_rms_norm
    with pytest.raises(ValueError, match="'combines_kv' is no operation"):
        Kernels("tpu", xla=("combines_kv",))
    with pytest.raises(ValueError, match="xla_kernels=.*'attention'"):
        EngineConfig(xla_kernels=["attention"])
    assert EngineConfig(kernel_impl="pallas", xla_kernels="flash_attention").kernels.flash_attention is None


def test_the_check_sees_the_model_as_one_device_runs_it(model_dir):
    """Heads per shard, each quantized matrix shape once (int4 g32 with offsets), the float gate | up
    weight for SwiGLU, the LoRA stacks per projection input (shapes seen before checked once)."""
    config = read_config(resolve_model(model_dir))
    _, state = abstract_model(config, jnp.float32, jnp.float32, lora=LoraTable(3, 8))
    flat = nested_to_flat(nnx.to_pure_dict(state))
    quantized = jax.eval_shape(lambda p: quantize_params(p, "int4", 32, skip=("layers.gate_up_proj",), symmetric=False), flat)
    shapes = step_shapes(config, quantized, dtype=jnp.float32, kv_dtype=jnp.float32, page_size=4, max_tokens=128)
    H, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    assert (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.hidden) == (6, 2, 16, 96)
    assert not shapes.flash_attention and shapes.paged_attention and shapes.kv_write  # 128 tokens: no flash step
    # qkv, and o and down (6 heads of 16 = I = 96: one check serves both); tied embeddings: no LM head matrix
    matrices = sorted((m.in_features, m.qweight.shape[-1]) for m in shapes.quantized)
    assert matrices == [(6 * D, H), (H, (6 + 2 * 2) * D)] == [(I, H), (H, 160)]
    assert all(m.mode == "int4" and m.group_size == 32 and m.offsets is not None for m in shapes.quantized)
    assert [w.shape for w in shapes.swiglu] == [(H, 2 * I)]
    assert [(site.a.shape, [b.shape for b in site.bs]) for site in shapes.lora] == [
        ((3, H, 24), [(3, 8, 6 * D), (3, 8, 2 * D), (3, 8, 2 * D)]), ((3, 6 * D, 8), [(3, 8, H)]),
        ((3, H, 16), [(3, 8, I), (3, 8, I)])]
    int8_pool = step_shapes(config, flat, dtype=jnp.float32, kv_dtype=jnp.int8, page_size=4, max_tokens=256)
    assert int8_pool.flash_attention and not int8_pool.paged_attention and not int8_pool.kv_write
    int8_pages_of_128 = step_shapes(config, flat, dtype=jnp.float32, kv_dtype=jnp.int8, page_size=128, max_tokens=256)
    assert int8_pages_of_128.paged_attention  # the TPU kernel reads the scales with the page


def test_the_tpu_attention_over_a_quantized_pool_in_pages_of_128_passes_its_check():
    """int8 entries and their scale pool, as quantizing normal values makes them, at a decode and a
    mixed step: the kernel (interpret mode) against the XLA attention."""
    shapes = dataclasses.replace(TINY, kv_dtype="int8", page_size=128)
    verdicts = run_checks(Kernels("tpu", interpret=True), shapes, operations=["ragged_attention"])
    assert len(verdicts) == 2 and all(v.verdict == "pass" for v in verdicts), verdicts


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_grouped_matmul_of_mxfp4_experts_passes_its_check_and_a_wrong_one_fails(platform):
    """GPT-OSS's experts kept 4-bit: a device's stack of 4 mxfp4 experts (the step's shapes), rows
    of a decode step's pairs with empty ones, the kernel (interpret mode) against the XLA path."""
    from jaxinfer.runtime.kernel_selfcheck import QuantizedMatrix, Tensor

    stack = QuantizedMatrix("mxfp4", 32, 256, Tensor((4, 128, 384), "uint8"), Tensor((4, 8, 384), "uint8"), None)
    shapes = dataclasses.replace(TINY, grouped=(stack,))
    [verdict] = run_checks(Kernels(platform, interpret=True), shapes, operations=["grouped_matmul"])
    assert verdict.verdict == "pass" and "mxfp4" in verdict.case and verdict.error < 1e-5, verdict
    wrong = Kernels(platform, interpret=True, grouped_matmul=plus_one(getattr(Kernels(platform, interpret=True), "grouped_matmul")))
    [verdict] = run_checks(wrong, shapes, operations=["grouped_matmul"])
    assert verdict.failed, verdict


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_latent_attention_passes_its_check_and_a_wrong_kernel_fails(platform):
    """DeepSeek's MLA: 2 heads over latent rows of 128 values + 64 rope dims (a TPU's rows padded to
    256 lanes) in a decode and a mixed step, the kernel (interpret mode) against the XLA path."""
    shapes = dataclasses.replace(TINY, latent=(128, 64), paged_attention=False, kv_write=False)
    kernels = Kernels(platform, interpret=True)
    verdicts = run_checks(kernels, shapes, operations=["mla_attention"])
    assert len(verdicts) == 2 and all(v.verdict == "pass" for v in verdicts), verdicts
    wrong = Kernels(platform, interpret=True, mla_attention=plus_one(kernels.mla_attention))
    assert all(v.failed for v in run_checks(wrong, shapes, operations=["mla_attention"]))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_attention_with_sinks_a_soft_cap_a_window_and_chunks_passes_its_check(platform):
    """GPT-OSS's sinks with Gemma 2's soft-cap, a window and Llama 4's chunks: what a model with them
    checks at start-up, each kernel (interpret mode) against the XLA attention."""
    shapes = dataclasses.replace(TINY, sinks=True, soft_cap=5.0, sliding_window=6, attention_chunk=8)
    verdicts = run_checks(Kernels(platform, interpret=True), shapes, operations=["ragged_attention"])
    assert len(verdicts) == 2 and all(v.verdict == "pass" for v in verdicts), verdicts
    assert all("soft_cap=5 sinks chunk=8" in v.case for v in verdicts)
    # the flash kernel with the chunk (its q_start path), on a fresh prefill of two sequences
    [flash] = run_checks(Kernels(platform, interpret=True), dataclasses.replace(shapes, sinks=False), operations=["flash_attention"])
    assert flash.verdict == "pass" and "chunk=8" in flash.case, flash


def test_the_standalone_script_prints_a_table(capsys):
    path = Path(__file__).resolve().parent.parent / "scripts" / "kernel_selfcheck.py"
    spec = importlib.util.spec_from_file_location("kernel_selfcheck_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--preset", "smollm2-135m", "--platform", "gpu", "--kernel", "add_rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "gpu kernels in interpret mode" in out and "NOT a run on the chip" in out
    assert out.count("| smollm2-135m | add_rms_norm | T=8 H=576 bfloat16") == 2 and "2 pass, 0 FAIL, 0 unchecked, 0 error" in out
