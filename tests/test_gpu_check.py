"""scripts/gpu_check.py, the one command for a GPU machine, runs end to end here in interpret mode
(its numbers mean nothing on a CPU; the point is that the script works when a GPU is at hand)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def test_gpu_check_writes_a_report_of_every_kernel_and_the_timings(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "report.md"
    assert gpu_check.main(["--interpret", "--small", "--iters", "1", "--out", str(out)]) == 0
    report = out.read_text()
    kernels = ("ragged_paged_attention", "flash_attention", "add_rms_norm", "swiglu_matmul", "quantized_matmul", "rope_kv_write")
    assert all(f"| {k} |" in report for k in kernels)
    assert "FAIL" not in report and "NOT a hardware run" in report
    assert report.count("decode attention") == 5 and report.count("quantized matmul") == 3
    assert report.count("sinks") == 2 and report.count("head_dim 512") == 3  # ragged decode + chunk (+ flash)
    assert "window 16" in report and "chunk 16" in report  # the windowed and chunked decodes beside the full one
    assert report.count("llama-4-scout") == 3  # ragged decode + prefill chunk + flash, with chunks
