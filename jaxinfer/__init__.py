"""jaxinfer: LLM inference in JAX.

    from jaxinfer import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

The names below are imported on first use, so `jaxinfer.cli` starts without importing JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "LLMEngine": "jaxinfer.engine.engine",
    "EngineConfig": "jaxinfer.engine.config",
    "build_engine": "jaxinfer.engine.build",
    "SamplingParams": "jaxinfer.sampling_params",
    "StructuredOutputsParams": "jaxinfer.sampling_params",
    "PoolingParams": "jaxinfer.pooling_params",
    "BeamSearchParams": "jaxinfer.beam_search",
    "LoRARequest": "jaxinfer.lora_request",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "Logprob": "jaxinfer.outputs",
    "RequestFailedError": "jaxinfer.outputs",
    "PoolingRequestOutput": "jaxinfer.outputs",
    "ScoringRequestOutput": "jaxinfer.outputs",
    "ModelConfig": "jaxinfer.config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
