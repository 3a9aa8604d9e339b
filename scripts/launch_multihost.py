"""Start one command as N cooperating JAX processes on this machine, and wait for all of them.

    python scripts/launch_multihost.py --num-processes 2 --cpu-devices-per-process 3 -- \\
        jaxinfer generate "Hello" --tensor-parallel-size 3 --data-parallel-size 2

Each process gets JAXINFER_COORDINATOR (127.0.0.1 and a free port, or --coordinator),
JAXINFER_NUM_PROCESSES and JAXINFER_PROCESS_ID, which `jaxinfer` commands and
`sharding.mesh.initialize_distributed()` read; the mesh then spans every process's devices.
- `--cpu-devices-per-process K`: each process sees K CPU devices (testing a multi-host layout on
  one machine);
- `--gpus-per-process K`: process i sees GPUs i*K .. i*K+K-1 (CUDA_VISIBLE_DEVICES), for one
  process per GPU group on a single multi-GPU host.

Output lines are prefixed with "[pI]". If any process fails, or `--timeout` seconds pass, the
others are stopped; the exit status is the first failure's (124 on timeout). On real clusters
run the command on every host yourself (see docs/parallelism.md): this script is the one-host
version of that.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def launch(command: list[str], num_processes: int, *, coordinator: str | None = None, cpu_devices: int | None = None,
           gpus_per_process: int | None = None, timeout: float | None = None, env: dict | None = None) -> int:
    """Runs `command` as num_processes cooperating processes; returns the exit status."""
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    procs, pumps = [], []
    for i in range(num_processes):
        proc_env = dict(os.environ if env is None else env)
        proc_env.update(JAXINFER_COORDINATOR=coordinator, JAXINFER_NUM_PROCESSES=str(num_processes), JAXINFER_PROCESS_ID=str(i))
        if cpu_devices:
            proc_env["JAX_PLATFORMS"] = "cpu"
            proc_env["XLA_FLAGS"] = f"{proc_env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={cpu_devices}".strip()
        if gpus_per_process:
            proc_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * gpus_per_process + g) for g in range(gpus_per_process))
        proc = subprocess.Popen(command, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", sys.stdout), daemon=True)
        pump.start()
        pumps.append(pump)

    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"launch_multihost: timed out after {timeout} s; stopping all processes", file=sys.stderr)
                status = 124
                break
            time.sleep(0.1)
        else:
            status = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [options] -- command ...")
    parser.add_argument("--num-processes", "-n", type=int, required=True)
    parser.add_argument("--coordinator", default=None, help="HOST:PORT (default: 127.0.0.1 and a free port)")
    parser.add_argument("--cpu-devices-per-process", type=int, default=None)
    parser.add_argument("--gpus-per-process", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before every process is stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.num_processes < 1:
        parser.error("--num-processes must be at least 1")
    return launch(command, args.num_processes, coordinator=args.coordinator, cpu_devices=args.cpu_devices_per_process,
                  gpus_per_process=args.gpus_per_process, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
