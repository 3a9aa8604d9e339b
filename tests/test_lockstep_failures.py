"""Serving on several processes: a failed step keeps every process on one path, or ends them all.

Two real processes joined by `jax.distributed` (loopback) post the requests their step failed
to the coordinator's store (`jaxinfer.server.lockstep.FailureBoard`). The same failures on both
(a request's own fault): both go on. A failure on one process only (a host's fault): both leave
within the agreement time, the other one too although it is stuck, as in a collective that will
never complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from launch_multihost import free_port  # noqa: E402

from jaxinfer.server.lockstep import EXIT_CODE  # noqa: E402

PROCESS = """
import sys, time
from sharding.mesh import initialize_distributed
initialize_distributed()
import jax
from jax._src import distributed
from jaxinfer.server.lockstep import FailureBoard
board = FailureBoard(agree_s=2.0, poll_ms=200)
board.watch()
distributed.global_state.client.wait_at_barrier("started", 60_000)  # as a step's collectives tie real processes
board.agree(7, ["req-3", "req-1"] if jax.process_index() else ["req-1", "req-3"])  # both: the requests' fault
time.sleep(3)  # past the agreement time
print("went on after iteration 7", flush=True)
if sys.argv[1] == "one" and jax.process_index() == 1:
    board.agree(8, ["req-4"])  # process 1 alone: a host's fault
time.sleep(15)  # stuck, as in a collective that will never complete
print("went on after iteration 8", flush=True)
board.close()
"""


def run_pair(scenario: str) -> list[tuple[int, float, str]]:
    """(exit status, seconds, output) of each of two processes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAXINFER_COORDINATOR=f"127.0.0.1:{free_port()}",
               JAXINFER_NUM_PROCESSES="2")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, scenario], env={**env, "JAXINFER_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("a process hung")
        results.append((proc.returncode, time.monotonic() - start, out))
    return results


def test_the_same_failures_go_on_and_a_failure_on_one_process_only_ends_every_process():
    results = run_pair("one")
    for status, seconds, out in results:
        assert "went on after iteration 7" in out, out  # the same failures on both: both went on
        assert status == EXIT_CODE and "went on after iteration 8" not in out, out
        assert "the serving set ends (process 1: iteration 8: process 1 failed requests [\"req-4\"], " \
               "process 0 nothing within 2.0 s" in out, out
