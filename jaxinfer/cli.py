"""`jaxinfer generate | chat | serve | quantize | prune | convert | aot`.

Parallel runs: `--tensor-parallel-size/-tp`, `--data-parallel-size/-dp`,
`--sequence-parallel-size/-sp`, `--pipeline-parallel-size/-pp`, `--expert-parallel-size/-ep` (or `--enable-expert-parallel`)
lay the model out on a mesh of every process's devices. On several hosts every process runs the
same command with `--coordinator HOST:PORT --num-processes N --process-id I` (or the
JAXINFER_COORDINATOR / JAXINFER_NUM_PROCESSES / JAXINFER_PROCESS_ID environment, which
`scripts/launch_multihost.py` sets), or `--multihost` alone where JAX finds the hosts itself
(TPU VMs, SLURM). Only process 0 prints; `serve` listens for HTTP on process 0 alone, the other
processes replaying its requests step by step (jaxinfer.server.lockstep).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    p.add_argument("--model", default=None, action="append" if several else "store",
                   help="HF folder, .gguf file, converted folder, or a Hugging Face Hub id: org/name, org/name:file.gguf "
                        "(default: embedded SmolLM2-135M-Instruct)" + ("; serve several models, each its own engine and "
                        "KV pool: --model NAME=PATH[,OPTION=VALUE...] repeated (options: quantization, "
                        "quantization_group_size, dtype, kv_cache_dtype, max_model_len, num_pages, kv_cache_memory, "
                        "revision, memory_share), and \"model\": \"auto\" asks --routing-policy" if several else ""))
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    p.add_argument("--dtype", default="auto", help="parameter dtype: auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", "--num-gpu-blocks-override", dest="num_pages", type=int, default=None,
                   help="KV pages per replica (default: sized by --kv-cache-memory or --gpu-memory-utilization)")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", type=_byte_count,
                   default=None, help="the KV pool's bytes per replica, e.g. 8GiB (default: the CPU 1GiB, else sized by "
                                      "--gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="TPU / GPU: the share of each device's memory for weights, step scratch and KV pool (default 0.9)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-prefix-states", type=int, default=None,
                   help="hybrid models (Qwen3.5, Qwen3-Next): recurrent states the prefix cache saves per replica "
                        "(default: max-num-seqs; 0: no prefix caching)")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory keeping prefix pages the device evicts, loaded back on a prefix hit (default: off)")
    p.add_argument("--kv-offloading-dir", default=None, metavar="DIR",
                   help="also write those pages to files here, for later hits and later processes (needs --kv-offloading-size)")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="bound of --kv-offloading-dir in GiB, least recently used pages deleted first (default: unbounded)")
    p.add_argument("--kv-cache-dtype", default=None, help="KV pages: float32 | bfloat16 | int8 | fp8 (default: the compute dtype)")
    p.add_argument("--kv-cache-outliers", type=int, default=0, metavar="R",
                   help="int8 / fp8 KV pages: R slots per page keeping the worst-quantized tokens' residuals in bfloat16 "
                        "(the first token always; default 0: off; jaxinfer.ops.kv_cache)")
    p.add_argument("--quantization", default=None, help="weight quantization: none | int8 | int4 | fp8 | w8a8 (int8 weights and activations)")
    p.add_argument("--quantization-group-size", type=int, default=None, help="int4: 32 | 64 | 128 (default 128); int8: per group")
    p.add_argument("--keep-checkpoint-quantization", action=argparse.BooleanOptionalAction, default=None,
                   help="run a GGUF / GPTQ / AWQ checkpoint's matrices in their own grid (default: on TPU / GPU, not on the CPU)")
    p.add_argument("--kernel-impl", "--attention-impl", dest="kernel_impl", default="auto",
                   help="auto | reference | pallas | pallas-tpu | pallas-gpu (see jaxinfer.ops.kernels)")
    par = p.add_argument_group("parallelism (a device mesh over every process's devices)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Megatron sharding of heads and MLP")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="independent replicas, requests balanced")
    par.add_argument("--sequence-parallel-size", "-sp", type=int, default=1, help="a step's tokens split (long prefills)")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="layers split into stages (models too big for a slice)")
    par.add_argument("--sequence-parallel-attention", choices=("allgather", "ring", "context"), default="allgather",
                     help="context: the KV pool split over the sequence axis too (context parallelism)")
    par.add_argument("--lm-head-parallel", choices=("hidden", "vocab"), default="hidden",
                     help="how tensor parallelism splits the LM head: vocab samples on the shards (docs/parallelism.md)")
    par.add_argument("--expert-parallel-size", "-ep", type=int, default=None, help="MoE experts split over devices")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="as in vLLM: the data-parallel replicas split the experts (ep = dp)")
    p.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    img = p.add_argument_group("images (Gemma 3, Qwen2.5-VL, Qwen3-VL)")
    img.add_argument("--limit-mm-per-prompt", type=_json_dict, default=None,
                     help='images one prompt may hold, e.g. \'{"image": 4}\' (default 16)')
    img.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="DOMAIN",
                     help="domains an image URL may be fetched from (default: none; data: URIs always work)")
    img.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                     help="image tokens the vision encoder computes per step (default: --max-num-batched-tokens)")
    img.add_argument("--encoder-cache-size", type=int, default=None,
                     help="encoder output rows kept by image hash (default: max(4096, 4 x --max-num-batched-tokens))")
    _add_distributed_args(p)


def _byte_count(text: str) -> int:
    """"8589934592", "8GiB", "8G", "512MiB", "512M" (binary units) -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 8589934592, 8GiB or 512MiB")
    return int(float(m.group(1)) * 1024 ** (" KMGT".index(m.group(2).upper()) if m.group(2) else 0))


def _json_dict(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("multi-host: every process runs the same command")
    d.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator (env JAXINFER_COORDINATOR)")
    d.add_argument("--num-processes", type=int, default=None, help="env JAXINFER_NUM_PROCESSES")
    d.add_argument("--process-id", type=int, default=None, help="env JAXINFER_PROCESS_ID")
    d.add_argument("--multihost", action="store_true", help="join a multi-process run JAX discovers itself (TPU VMs, SLURM)")


def _maybe_initialize_distributed(args) -> None:
    """jax.distributed.initialize when flags or the environment ask for a multi-process run."""
    import os

    from sharding.mesh import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, initialize_distributed

    given = (getattr(args, "coordinator", None), getattr(args, "num_processes", None), getattr(args, "process_id", None))
    from_env = any(os.environ.get(v) for v in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))
    if getattr(args, "multihost", False) or from_env or any(v is not None for v in given):
        initialize_distributed(*given)


def _is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _llm(args, **extra):
    from jaxinfer import LLM

    return LLM(
        args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_outliers=args.kv_cache_outliers,
        quantization=args.quantization, quantization_group_size=args.quantization_group_size,
        keep_checkpoint_quantization=args.keep_checkpoint_quantization, kernel_impl=args.kernel_impl,
        max_model_len=args.max_model_len, page_size=args.page_size, revision=args.revision,
        num_pages=args.num_pages, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_prefix_states=args.num_prefix_states, kv_offloading_size=args.kv_offloading_size,
        kv_offloading_dir=args.kv_offloading_dir, kv_offloading_disk_size=args.kv_offloading_disk_size,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.sequence_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, sequence_parallel_attention=args.sequence_parallel_attention,
        lm_head_parallel=args.lm_head_parallel, speculative_config=args.speculative_config, limit_mm_per_prompt=args.limit_mm_per_prompt,
        allowed_media_domains=tuple(args.allowed_media_domains), max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        encoder_cache_size=args.encoder_cache_size, progress=_is_main_process(),
        runner=getattr(args, "runner", "generate"), pooler_config=getattr(args, "pooler_config", None), **extra,
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"jaxinfer serve: --lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def _sampling(args):
    from jaxinfer import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def cmd_generate(args) -> int:
    """Prints each answer; one prompt streams token by token. `--verbose` times the start."""
    import time

    from jaxinfer.startup import PhaseClock, compile_totals, format_report

    before_main = args._process_age_at_main
    clock = PhaseClock()
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("jaxinfer generate: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    import jaxinfer.llm  # noqa: F401  (jax, flax and the engine: timed on their own)

    compiles_before = compile_totals()
    clock.mark("imports (jax, flax, jaxinfer)")
    llm = _llm(args)
    clock.mark("LLM(...)")
    main = _is_main_process()
    params = _sampling(args)
    if args.chat:
        prompts_in = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    else:
        prompts_in = prompts
    first_token = None
    tokens = 0
    if len(prompts) == 1:
        printed = ""
        for out in llm.stream(prompts_in[0], params):
            text = out.outputs[0].text
            if main and len(text) > len(printed):
                if first_token is None:
                    first_token = time.perf_counter() - clock.t0 + (before_main or 0.0)
                print(text[len(printed):], end="", flush=True)
                printed = text
            tokens = len(out.outputs[0].token_ids)
        if main:
            print()
    else:
        outputs = llm.generate(prompts_in, params, use_tqdm=main)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if main:
            for prompt, out in zip(prompts, outputs):
                print(f"### {prompt}")
                print(out.outputs[0].text)
    clock.mark("generate")
    if args.verbose and main:
        rows = []
        for name, secs in clock.phases.items():
            if name == "LLM(...)":  # its own phases, and what they leave out
                rows += [(f"LLM: {n}", s, f"its own {llm.tokenizer_seconds:.2f} s, in a thread beside the weights"
                          if n.startswith("tokenizer") else "") for n, s in llm.startup_seconds.items()]
                rows.append(("LLM: other", max(0.0, secs - sum(llm.startup_seconds.values())), ""))
            else:
                rows.append((name, secs, f"{tokens} tokens" if name == "generate" else ""))
        print(format_report(rows, before_main=before_main, first_token=first_token,
                            compiles=compile_totals().minus(compiles_before)), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    params = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def _env_flag(name: str) -> bool:
    import os

    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cmd_serve(args) -> int:
    import contextlib
    import os
    import signal

    import jax
    import uvicorn  # the serve extra

    from jaxinfer.server.app import build_app
    from jaxinfer.server.lockstep import Publisher, follow

    from jaxinfer.server.multi_model import is_model_spec

    models = args.model or []
    if len(models) > 1 or any(is_model_spec(m) for m in models):  # --model NAME=PATH: several models, one server
        return _serve_several(args)
    given = [f for f, v in (("--routing-policy", args.routing_policy), ("--route-under-load", args.route_under_load),
                            ("--adaptive-precision", args.adaptive_precision)) if v]
    if given:
        print(f"jaxinfer serve: {given[0]} routes between several models: give --model NAME=PATH for each", file=sys.stderr)
        return 2
    args.model = models[0] if models else None
    if args.model_path is not None:
        args.model = args.model_path
    lora_modules = dict(_lora_module(m) for m in args.lora_modules or [])
    if lora_modules and not args.enable_lora:
        print("jaxinfer serve: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    result_cache_error = _result_cache_error(args)
    if result_cache_error is not None:
        print(f"jaxinfer serve: {result_cache_error}", file=sys.stderr)
        return 2
    llm = _llm(args, warmup=args.warmup, **({"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
                                            if args.enable_lora else {}))
    if not _is_main_process():  # process 0 serves HTTP; this one replays its requests and steps with it
        n = follow(llm.engine, grace_s=args.shutdown_timeout + 30)
        stats = llm.engine.get_stats()
        print(f"jaxinfer: process {jax.process_index()} stopped after {n} iterations with process 0; "
              f"unfinished requests {stats.num_running + stats.num_waiting}, KV cache usage {stats.kv_cache_usage:.0%}",
              file=sys.stderr, flush=True)
        return 0
    allow_lora_updating = args.allow_runtime_lora_updating or _env_flag("JAXINFER_ALLOW_RUNTIME_LORA_UPDATING")
    try:
        kv_transfer = None
        if args.kv_role is not None:
            from jaxinfer.server.kv_transfer import KVTransfer

            kv_transfer = KVTransfer(args.kv_role, llm.runner, llm.config.model_type, host=args.kv_transfer_host,
                                     port=args.kv_transfer_port, timeout_s=args.kv_transfer_timeout)
        result_cache = _result_cache(args)
        app = build_app(llm, served_model_name=args.served_model_name, api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"),
                        max_queue=args.max_queue, request_timeout=args.request_timeout,
                        publisher=Publisher() if jax.process_count() > 1 else None, tool_call_parser=args.tool_call_parser,
                        lora_modules=lora_modules, allow_runtime_lora_updating=allow_lora_updating,
                        chat_template=args.chat_template, generation_config=args.generation_config,
                        max_request_bytes=args.max_request_bytes, kv_transfer=kv_transfer,
                        reasoning_parser=args.reasoning_parser, result_cache=result_cache)
    except ValueError as e:
        print(f"jaxinfer serve: {e}", file=sys.stderr)
        return 2
    print(f"jaxinfer: {llm.engine.kv_cache_summary}", file=sys.stderr)
    if result_cache is not None:
        print(f"jaxinfer: {result_cache.kind} result cache of {result_cache.max_entries} answers for {result_cache.ttl_s:g} s"
              + (f", similarity >= {result_cache.similarity:g} by {args.embedding_model}" if result_cache.semantic else ""),
              file=sys.stderr)
    if kv_transfer is not None:
        print(f"jaxinfer: {args.kv_role} instance, KV transfer server at {kv_transfer.address}", file=sys.stderr)
    print(f"jaxinfer: serving {app.state.model_name!r} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    # SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for shutdown_timeout seconds,
    # then cancel them (each aborts its request); the engine thread stops with the app; exit 0.
    # (Our handlers, not uvicorn's: uvicorn re-raises the signal after its shutdown, exiting -15.)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    server.run()
    return 0


def _serve_several(args) -> int:
    """`jaxinfer serve --model NAME=PATH --model NAME=PATH ...`: every model in this process, each
    its own engine and its share of the memory (jaxinfer.server.multi_model), "auto" routed."""
    import contextlib
    import os
    import signal

    import jax
    import uvicorn  # the serve extra

    from jaxinfer.server.multi_model import build_multi_model_app, model_settings, parse_model_spec
    from jaxinfer.server.routing import RoutingPolicy

    refused = [(args.model_path is not None, "a positional MODEL (give each model as --model NAME=PATH)"),
               (args.served_model_name is not None, "--served-model-name (each model is served as its NAME)"),
               (args.enable_lora or bool(args.lora_modules), "--enable-lora / --lora-modules (adapters of one model)"),
               (args.kv_role is not None, "--kv-role (prefill/decode disaggregation serves one model)"),
               (getattr(args, "result_cache", None) is not None, "--result-cache"),
               (jax.process_count() > 1, "several processes")]
    for bad, what in refused:
        if bad:
            print(f"jaxinfer serve: several --model NAME=PATH: not with {what}", file=sys.stderr)
            return 2
    try:
        specs = [parse_model_spec(m) for m in args.model]
        settings = model_settings(specs, gpu_memory_utilization=args.gpu_memory_utilization,
                                  kv_cache_memory_bytes=args.kv_cache_memory_bytes)
        policy = RoutingPolicy.from_options([spec.name for spec in specs], args.routing_policy, args.route_under_load,
                                            args.adaptive_precision)
    except ValueError as e:
        print(f"jaxinfer serve: {e}", file=sys.stderr)
        return 2
    llms = {spec.name: _llm(argparse.Namespace(**{**vars(args), **own}), warmup=args.warmup)
            for spec, own in zip(specs, settings)}
    try:
        app = build_multi_model_app(
            llms, policy=policy, api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"), max_queue=args.max_queue,
            request_timeout=args.request_timeout, tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
            generation_config=args.generation_config, max_request_bytes=args.max_request_bytes,
            **({"reasoning_parser": args.reasoning_parser} if getattr(args, "reasoning_parser", None) else {}))
    except ValueError as e:
        print(f"jaxinfer serve: {e}", file=sys.stderr)
        return 2
    for name, llm in llms.items():
        print(f"jaxinfer: {name}: {llm.engine.kv_cache_summary}", file=sys.stderr)
    print(f"jaxinfer: serving {list(llms)} and 'auto' on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.capture_signals = contextlib.nullcontext  # SIGTERM drains as cmd_serve's server does
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    server.run()
    return 0


def _result_cache_error(args) -> str | None:
    """What is wrong with serve's result cache flags, naming the flag (None: nothing)."""
    import math

    optional = (("--result-cache-size", args.result_cache_size), ("--result-cache-ttl", args.result_cache_ttl),
                ("--embedding-model", args.embedding_model), ("--similarity", args.similarity))
    if args.result_cache is None:
        given = [flag for flag, value in optional if value is not None]
        return f"{given[0]} needs --result-cache exact or semantic" if given else None
    if args.runner == "pooling":
        return "--result-cache caches generated answers: not with --runner pooling"
    if args.result_cache_size is not None and args.result_cache_size < 1:
        return f"--result-cache-size {args.result_cache_size}: expected a positive number of entries"
    if args.result_cache_ttl is not None and not 0 < args.result_cache_ttl < math.inf:
        return f"--result-cache-ttl {args.result_cache_ttl}: expected a positive number of seconds"
    if args.result_cache == "exact":
        given = [flag for flag, value in optional[2:] if value is not None]
        return f"{given[0]} needs --result-cache semantic" if given else None
    if args.embedding_model is None:
        return "--result-cache semantic needs --embedding-model PATH (an embedding model, loaded with runner='pooling')"
    if args.similarity is not None and not 0 < args.similarity <= 1:
        return f"--similarity {args.similarity}: expected a cosine similarity in (0, 1]"
    import jax

    if jax.process_count() > 1:
        return "--result-cache semantic: its embedding model runs on one process; use --result-cache exact on several"
    return None


EMBEDDING_MAX_MODEL_LEN = 1024  # tokens of a question the semantic cache embeds (longer ones: exact lookups only)
EMBEDDING_KV_BYTES = 256 * 2**20  # the embedding model's KV pool, beside the served model's


def _result_cache(args):
    """serve's ResultCache (None without --result-cache); the semantic one loads the embedding
    model, after the served model: its weights and a 256 MiB pool take what
    --gpu-memory-utilization leaves on a GPU."""
    if args.result_cache is None:
        return None
    from jaxinfer.server.result_cache import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, ResultCache, llm_embedder

    size = args.result_cache_size if args.result_cache_size is not None else DEFAULT_MAX_ENTRIES
    ttl = args.result_cache_ttl if args.result_cache_ttl is not None else DEFAULT_TTL_S
    if args.result_cache == "exact":
        return ResultCache(size, ttl)
    from jaxinfer import LLM
    from jaxinfer.runtime.loading import read_config, resolve_model

    longest = min(EMBEDDING_MAX_MODEL_LEN, read_config(resolve_model(args.embedding_model)).max_position_embeddings)
    embedder = LLM(args.embedding_model, runner="pooling", max_model_len=longest, kv_cache_memory_bytes=EMBEDDING_KV_BYTES,
                   max_num_seqs=8, progress=_is_main_process())
    return ResultCache(size, ttl, embed=llm_embedder(embedder), similarity=args.similarity)


def cmd_router(args) -> int:
    import os

    from jaxinfer.server.router import run_router

    return run_router(args.prefill, args.decode, host=args.host, port=args.port, timeout=args.request_timeout,
                      api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"))


def cmd_convert(args) -> int:
    from jaxinfer.engine.config import dtype_of
    from jaxinfer.runtime.loading import load_params, read_config, resolve_model, save_converted
    from jaxinfer.tokenizer import load_tokenizer

    source = resolve_model(args.src, revision=args.revision)
    config = read_config(source)
    dtype = dtype_of(args.dtype, "dtype")
    _, state = load_params(source, config, dtype, dtype, keep_quantized=False)  # converted folders hold floats
    dst = save_converted(args.dst, config, state, load_tokenizer(source), overwrite=args.overwrite)
    print(f"wrote {dst} ({config.model_type}, {config.num_layers} layers, {dtype.__name__})")
    return 0


def cmd_quantize(args) -> int:
    from jaxinfer.calibration import quantize

    out = quantize(args.model, args.out, method=args.method, bits=args.bits, group_size=args.group_size,
                   symmetric=args.symmetric, act_order=args.act_order, num_tokens=args.num_tokens, seq_len=args.seq_len,
                   alpha=args.alpha, **_calibration_options(args))
    if args.method == "smoothquant":
        print(f"wrote {out} (smoothquant, alpha {args.alpha}: W8A8, int8 weights per column, int8 activations per token)")
    else:
        print(f"wrote {out} ({args.method}, {args.bits}-bit, groups of {args.group_size})")
    _print_kept_layers(out)
    return 0


def _calibration_options(args) -> dict:
    """quantize's and prune's shared keyword arguments: the calibration and held-out texts, the
    sensitivity options, the progress log (--verbose)."""
    def read(path):
        if not path:
            return None
        with open(path) as f:
            return f.read()

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    return dict(calibration_text=read(args.calibration_file), log=log, keep_sensitive=args.keep_sensitive,
                ppl_budget=args.ppl_budget, sensitivity_text=read(args.sensitivity_file))


def _print_kept_layers(out) -> None:
    """The layers --keep-sensitive / --ppl-budget kept in floats, as the written config records them."""
    import json
    from pathlib import Path

    record = json.loads((Path(out) / "config.json").read_text()).get("jaxinfer_compression")
    if record:
        ppl = record["held_out_perplexity"]
        alone = ppl["one_layer_compressed"]
        layers = ", ".join(f"{i} ({alone[i]:.3f})" for i in record["kept_float_layers"]) or "none"
        print(f"kept in floats: layers {layers} (held-out perplexity with only that layer compressed); held-out "
              f"perplexity {ppl['compressed']:.3f} (float {ppl['float']:.3f})")


def cmd_prune(args) -> int:
    from jaxinfer.calibration import prune

    out = prune(args.model, args.out, method=args.method, sparsity=args.sparsity, pattern=args.pattern, bits=args.bits,
                quant_method=args.quant_method, group_size=args.group_size, symmetric=args.symmetric,
                num_tokens=args.num_tokens, seq_len=args.seq_len, **_calibration_options(args))
    shape = args.pattern or f"{args.sparsity if args.sparsity is not None else 0.5:g} unstructured"
    quant = f", then {args.quant_method or 'gptq'} {args.bits}-bit groups of {args.group_size}" if args.bits else ""
    print(f"wrote {out} ({args.method}, {shape}{quant})")
    _print_kept_layers(out)
    return 0


def _add_sensitivity_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("per-layer sensitivity (jaxinfer.calibration.sensitivity)")
    g.add_argument("--keep-sensitive", type=int, default=0, metavar="N",
                   help="keep in floats the N decoder layers whose compression alone costs the most held-out perplexity; "
                        "written in the checkpoint's config and printed")
    g.add_argument("--ppl-budget", type=float, default=None, metavar="PCT",
                   help="keep as few of the most sensitive layers in floats as hold the held-out perplexity within PCT %% "
                        "of the float model's")
    g.add_argument("--sensitivity-file", default=None,
                   help="held-out text for the sensitivity (default: jaxinfer/calibration/sensitivity.txt)")


def cmd_aot(args) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")  # the target is described, not opened: no plugin may look for a chip
    from jaxinfer.aot.plan import format_plan, plan_deployment
    from jaxinfer.aot.presets import read_hf_dict, read_model_config
    from jaxinfer.aot.step_compile import ServingShape
    from jaxinfer.aot.targets import compile_target
    from jaxinfer.aot.vision_compile import vision_spec
    from sharding.mesh import ParallelConfig

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = read_model_config(args.model)
    image_size = tuple(int(v) for v in args.image_size.lower().split("x")) if args.image_size else None
    vision = vision_spec(read_hf_dict(args.model), args.images_per_step, image_size)  # None: text only
    target = compile_target(args.topology, num_slices=args.num_slices)
    parallel = ParallelConfig(dp=args.data_parallel_size, tp=args.tensor_parallel_size, ep=args.expert_parallel_size,
                              pp=args.pipeline_parallel_size, sp=args.sequence_parallel_size,
                              sp_attention=args.sequence_parallel_attention)
    shape = ServingShape(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, num_pages=args.num_pages,
                         num_prefix_states=args.num_prefix_states,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                         dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                         group_size=args.group_size, keep_checkpoint_quantization=args.keep_checkpoint_quantization,
                         sparsity=args.sparsity)
    print(f"compiling for {target.describe()} ({target.num_chips} x {target.chip.kind}) ...", file=sys.stderr, flush=True)

    def progress(b):
        print(f"  {b.kind} T={b.key.num_tokens} S={b.key.num_seqs} R={b.key.num_logits}: {b.seconds:.1f} s", file=sys.stderr, flush=True)

    if vision is not None:
        print(f"  image encoder: {vision.describe()} ...", file=sys.stderr, flush=True)
    print(format_plan(plan_deployment(config, target, parallel, shape, jobs=args.jobs, on_bucket=progress, vision=vision)))
    return 0


def main(argv=None) -> int:
    import os

    from jaxinfer.startup import process_age_seconds

    process_age = process_age_seconds()
    # transformers, imported for the tokenizer, tells every torch-less process that torch is missing.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*")
    g.add_argument("--prompts-file", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--verbose", "-v", action="store_true",
                   help="print where the seconds of the start went (imports, tokenizer, weights, compiles)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat interactively on stdin")
    c.add_argument("--system", default=None, help="a system message")
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="serve the OpenAI API over HTTP (needs the serve extra: pip install 'jaxinfer[serve]')")
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="the model (or --model)")
    _add_model_args(s, several=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model folder's)")
    s.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                   help="'pooling': serve an embedding or reranking model (/v1/embeddings, /v1/score, /v1/rerank) "
                        "instead of generating (default generate)")
    s.add_argument("--pooler-config", type=json.loads, default=None, metavar="JSON",
                   help='with --runner pooling: the pooling over the model\'s own, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": true}\'')
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 routes and /tokenize, /detokenize "
                        "(default: the JAXINFER_API_KEY environment variable; neither: no key)")
    s.add_argument("--max-queue", type=int, default=None, help="requests waiting for a slot beyond which new ones get 429")
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (a request's model names one)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", help="PEFT adapters to serve, by name")
    s.add_argument("--max-loras", type=int, default=4, help="adapters in the device's slot table at once (default 4)")
    s.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served (default 16)")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (clients then make the server read "
                        "any folder it can; also JAXINFER_ALLOW_RUNTIME_LORA_UPDATING=1)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the tokenizer's")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for the fields a request leaves unset: 'auto' the model's generation_config.json "
                        "(as vLLM: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), 'vllm' none, "
                        "or a folder holding a generation_config.json (default auto)")
    s.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="request bodies over this many bytes get 413 (default 16 MiB)")
    s.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="the tool-call format of the model's chat template (default: detected from the template)")
    s.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                   help="split a chat reply's <think>...</think> into message.reasoning_content (delta.reasoning_content "
                        "streamed); a response_format / structured_outputs constraint then applies after </think>")
    s.add_argument("--request-timeout", type=float, default=None, help="seconds a request may take (504 past it)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests get to finish before they are aborted")
    s.add_argument("--warmup", action="store_true", help="compile every shape bucket before accepting requests")
    mm = s.add_argument_group("several models (--model NAME=PATH repeated; jaxinfer.server.multi_model)")
    mm.add_argument("--routing-policy", default=None, metavar="KEY=VALUE,...",
                    help='how "model": "auto" picks: small=NAME,large=NAME (default: the first and the last --model), '
                         "long_prompt_tokens=N (longer prompts: large), confidence_threshold=X (the small model's mean "
                         "prompt-token logprob below X: large; costs a prefill on the small model), threshold_min=X, "
                         "threshold_max=X, feedback_step=X (POST /v1/routing/feedback moves the threshold)")
    mm.add_argument("--route-under-load", default=None, metavar="high=NAME,low=NAME,queue=N",
                    help='"auto" requests bound for the high-precision model go to the low-precision one while it '
                         "holds more than N requests (waiting + running)")
    mm.add_argument("--adaptive-precision", action="store_true",
                    help="--route-under-load also moves requests that name the high-precision model")
    kv = s.add_argument_group("prefill/decode disaggregation (behind `jaxinfer router`)")
    kv.add_argument("--kv-role", choices=("prefill", "decode"), default=None,
                    help="prefill: compute prompts and offer their KV pages; decode: pull them and generate")
    kv.add_argument("--kv-transfer-host", default="127.0.0.1", help="the address the KV transfer server binds and advertises")
    kv.add_argument("--kv-transfer-port", type=int, default=0, help="the KV transfer server's port (default 0: any free one)")
    kv.add_argument("--kv-transfer-timeout", type=float, default=60.0,
                    help="seconds an offered prompt's pages wait to be pulled, and a pull may take (default 60)")
    rc = s.add_argument_group("result caches (answers of repeated deterministic requests, the engine bypassed)")
    rc.add_argument("--result-cache", choices=("exact", "semantic"), default=None,
                    help="exact: a request equal to an earlier one (temperature 0 or a seed; same model, prompt and "
                         "parameters) gets its answer; semantic: also a near-duplicate question, by embedding "
                         "similarity (can answer wrongly: opt-in) (default: off)")
    rc.add_argument("--result-cache-size", type=int, default=None, help="answers kept, least recently used dropped first "
                                                                         "(default 1024)")
    rc.add_argument("--result-cache-ttl", type=float, default=None, metavar="SECONDS",
                    help="seconds an answer is kept (default 600)")
    rc.add_argument("--embedding-model", default=None, metavar="PATH",
                    help="--result-cache semantic: the embedding model (HF folder or Hub id, loaded with runner='pooling')")
    rc.add_argument("--similarity", type=float, default=None,
                    help="--result-cache semantic: the least cosine similarity of a hit, in (0, 1] (default 0.95)")
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="an OpenAI-compatible front over prefill and decode instances (jaxinfer serve --kv-role)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://host:port)")
    r.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://host:port)")
    r.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds for an instance to answer (a prefill's whole answer; a decode's first bytes) (default 120)")
    r.add_argument("--api-key", default=None, help="sent to the instances as 'Authorization: Bearer <key>' "
                                                   "(default: the JAXINFER_API_KEY environment variable)")
    r.set_defaults(func=cmd_router)

    q = sub.add_parser("quantize", help="quantize a model's weights (RTN, GPTQ, AWQ or SmoothQuant W8A8 from calibration text) into a checkpoint")
    q.add_argument("model", nargs="?", default=None, help="HF folder, .gguf or converted folder (default: embedded SmolLM2)")
    q.add_argument("out", help="the folder to write (GPTQ, AWQ or compressed-tensors layout; LLM(out) loads it)")
    q.add_argument("--method", choices=("rtn", "gptq", "awq", "smoothquant"), default="gptq",
                   help="smoothquant: W8A8 (with --bits 8; int8 weights per column, int8 activations per token)")
    q.add_argument("--bits", type=int, choices=(4, 8), default=4)
    q.add_argument("--group-size", type=int, default=128)
    q.add_argument("--symmetric", action="store_true", help="no zero points (GPTQ, RTN)")
    q.add_argument("--act-order", action="store_true", help="GPTQ: quantize inputs in order of importance (desc_act)")
    q.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant: how much of the activations' range moves to the weights (0..1)")
    q.add_argument("--calibration-file", default=None, help="text to calibrate on (default: jaxinfer/calibration/calibration.txt)")
    q.add_argument("--num-tokens", type=int, default=512, help="calibration tokens")
    q.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    q.add_argument("--verbose", "-v", action="store_true", help="print each layer's time")
    _add_sensitivity_arguments(q)
    q.set_defaults(func=cmd_quantize, coordinator=None, num_processes=None, process_id=None, multihost=False)

    pr = sub.add_parser("prune", help="prune a model's weights (magnitude, Wanda or SparseGPT from calibration text; "
                                      "unstructured or 2:4) into a compressed-tensors sparse checkpoint")
    pr.add_argument("model", nargs="?", default=None, help="HF folder, .gguf or converted folder (default: embedded SmolLM2)")
    pr.add_argument("out", help="the folder to write (compressed-tensors sparse-bitmask / sparse-24-bitmask; LLM(out) loads it)")
    pr.add_argument("--method", choices=("magnitude", "wanda", "sparsegpt"), default="sparsegpt")
    pr.add_argument("--sparsity", type=float, default=None, help="the fraction of each matrix pruned (default 0.5)")
    pr.add_argument("--pattern", choices=("2:4",), default=None,
                    help="2:4: two of every four consecutive input weights of each output are zero (default: unstructured)")
    pr.add_argument("--bits", type=int, choices=(4, 8), default=None,
                    help="then quantize the pruned weights (compressed-tensors pack-quantized, the zeros kept)")
    pr.add_argument("--quant-method", choices=("gptq", "rtn"), default=None, help="with --bits (default gptq)")
    pr.add_argument("--group-size", type=int, default=128, help="with --bits")
    pr.add_argument("--symmetric", action="store_true", help="with --bits: no zero points")
    pr.add_argument("--calibration-file", default=None, help="text to calibrate on (default: jaxinfer/calibration/calibration.txt)")
    pr.add_argument("--num-tokens", type=int, default=512, help="calibration tokens")
    pr.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    pr.add_argument("--verbose", "-v", action="store_true", help="print each layer's time")
    _add_sensitivity_arguments(pr)
    pr.set_defaults(func=cmd_prune, coordinator=None, num_processes=None, process_id=None, multihost=False)

    v = sub.add_parser("convert", help="convert an HF folder, GGUF file or Hub id to a jaxinfer (orbax) folder")
    v.add_argument("src", help="HF folder, .gguf file, or a Hugging Face Hub id (org/name, org/name:file.gguf)")
    v.add_argument("dst")
    v.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    v.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    v.add_argument("--overwrite", action="store_true", help="replace an existing converted folder")
    v.set_defaults(func=cmd_convert)

    a = sub.add_parser("aot", help="compile every step bucket for a TPU or GPU target, no chip needed: does it fit, how fast")
    a.add_argument("--model", required=True,
                   help="a config.json, model folder or .gguf (only the config is read), or a preset: "
                        "llama-3.1-8b, llama-3.1-70b, llama-3.2-1b, mistral-7b, qwen2.5-7b, qwen3-8b, mixtral-8x7b, smollm2-135m, "
                        "gemma-3-27b, gemma-3-27b-it, gpt-oss-120b, gpt-oss-20b, llama-4-scout, gemma-4-31b, deepseek-v3")
    a.add_argument("--topology", required=True, help="v5e:2x4, v6e:2x2, v5p:2x2x1, v6e:1 (chips), h100, h200")
    a.add_argument("--num-slices", type=int, default=1,
                   help="TPU multi-slice: that many slices of --topology joined by DCN (e.g. --topology v5e:4x4 --num-slices 2); "
                        "the pipeline stages (-pp, a multiple of the slices), else the data replicas, go across them")
    a.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages (layers split over the outermost mesh axis; across slices with --num-slices)")
    a.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    a.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    a.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
    a.add_argument("--sequence-parallel-size", "-sp", type=int, default=1)
    a.add_argument("--sequence-parallel-attention", choices=("allgather", "ring", "context"), default="context",
                   help="with -sp > 1: 'context' (default here: the KV pool split over the sequence axis, so each chip "
                        "holds 1/sp of every sequence's pages) or the engine's default 'allgather' / 'ring' (pool replicated)")
    a.add_argument("--max-model-len", type=int, required=True)
    a.add_argument("--max-num-seqs", type=int, default=64)
    a.add_argument("--num-prefix-states", type=int, default=None,
                   help="hybrid models: the prefix cache's saved recurrent states per replica (default: max-num-seqs)")
    a.add_argument("--max-num-batched-tokens", type=int, default=512)
    a.add_argument("--page-size", type=int, default=16)
    a.add_argument("--num-pages", "--num-gpu-blocks-override", dest="num_pages", type=int, default=None,
                   help="KV pages per replica (default: as the engine sizes it, --kv-cache-memory or --gpu-memory-utilization)")
    a.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", type=_byte_count,
                   default=None, help="the KV pool's bytes per replica, e.g. 8GiB")
    a.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the share of each chip's HBM for weights, step scratch and KV pool (default 0.9)")
    a.add_argument("--dtype", default="bfloat16")
    a.add_argument("--kv-cache-dtype", default=None, help="default: --dtype; int8 or float8_e4m3fn halve the pool")
    a.add_argument("--quantization", choices=("int8", "int4", "fp8", "w8a8"), default=None)
    a.add_argument("--group-size", type=int, default=128, help="int4 group size")
    a.add_argument("--sparsity", choices=("2:4",), default=None,
                   help="2:4: plan the projections 2:4 sparse, kept compressed (values + bitmask, ~56%% of bf16) and read "
                        "by the sparse24_matmul kernel; prints the decode roofline against dense weights")
    a.add_argument("--keep-checkpoint-quantization", action=argparse.BooleanOptionalAction, default=True,
                   help="experts a checkpoint stores mxfp4 (GPT-OSS) stay 4-bit, as a TPU / GPU loads them (default); "
                        "--no-keep-checkpoint-quantization plans them in --dtype")
    a.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, help="programs compiled at once (default: one per CPU core; XLA compiles outside the GIL)")
    a.add_argument("--images-per-step", type=int, default=1,
                   help="a model with a vision tower (Gemma 3, Qwen2.5-VL): images per image-encoder call, compiled for "
                        "the target beside the step (default 1; 0: text only)")
    a.add_argument("--image-size", default=None, metavar="HxW",
                   help="Qwen2.5-VL: the image size compiled, in pixels (default 896x896); Gemma 3 takes its processor's only")
    a.add_argument("--cache-dir", default=None,
                   help="also write each compiled bucket into this JAX compilation cache (experimental: see docs/aot.md)")
    a.set_defaults(func=cmd_aot, coordinator=None, num_processes=None, process_id=None, multihost=False)

    args = parser.parse_args(argv)
    args._process_age_at_main = process_age if argv is None else None  # None: called from Python, not a fresh process
    try:
        _maybe_initialize_distributed(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
