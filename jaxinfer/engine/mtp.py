"""The multi-token-prediction proposer of speculative decoding (method "mtp"): DeepSeek-V3's MTP layer drafts.

    LLM("deepseek-ai/DeepSeek-V3", speculative_config={"method": "mtp", "num_speculative_tokens": 1})

The checkpoint's MTP module (`jaxinfer.models.deepseek_mtp`) guesses t_{p+2} at position p from
the target's hidden state h_p (the residual stream after its last layer:
`StepFunction(return_stream=True)`) and the token t_{p+1}. It runs as a one-layer model behind its
own `ModelRunner` with its own latent pool at the target's page ids, in lockstep with the target:
after each target step it ingests the rows the target kept, then drafts k tokens, each guess from
the one before and the module's own stream (`jaxinfer.engine.stream_proposer`, shared with
EAGLE-3 heads).
"""

from __future__ import annotations

from jaxinfer.engine.stream_proposer import StreamChainProposer


class MTPProposer(StreamChainProposer):
    """DeepSeek's MTP module as a `StreamChainProposer` (its runner returns its own stream)."""
