"""jaxinfer: LLM inference in JAX.

    from jaxinfer import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from jaxinfer.beam_search import BeamSearchParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput
from jaxinfer.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob", "ModelConfig"]
