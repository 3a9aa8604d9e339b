"""The EAGLE-3 proposer of speculative decoding (method "eagle3"): a published EAGLE-3 head drafts.

    LLM("meta-llama/Llama-3.1-8B-Instruct",
        speculative_config={"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3})

The head (`jaxinfer.models.eagle3`: one Llama layer reading three of the target's residual
streams beside each token) runs exactly as DeepSeek's MTP layer does (`jaxinfer.engine.
stream_proposer`): behind its own `ModelRunner` with its own KV pool at the target's page ids,
ingesting after each target step the rows the target kept (row p reads the target's aux streams
at p, [3 * Ht] from the target step itself: `StepFunction(return_stream=aux_layers)`, and the
token t_{p+1}), then chaining guesses, each reading the previous guess and the head's own
pre-norm output at the previous position. The draft's logits are the draft vocabulary's at their
target ids and -inf elsewhere, so its distributions q live in the target's vocabulary and the
verification stays exact: greedy text equals plain greedy decoding, sampled text keeps the
target's distribution.

Draft trees (`speculative_token_tree`: static paths or "dynamic" with tree_top_k / tree_depth,
engine.spec_decode): the head drafts a tree level by level, one head step per level whose
chunks hold that level's nodes at fresh slots with tree masks (each node reads its token and its
parent row's pre-norm output, at position root + depth, seeing the prefix and its ancestors);
its top-ranked tokens are the nodes, verified as one-hot proposals (`jaxinfer.engine.
stream_proposer`, "Draft trees").

    LLM("meta-llama/Llama-3.1-8B-Instruct",
        speculative_config={"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                            "num_speculative_tokens": 16, "speculative_token_tree": "dynamic",
                            "tree_top_k": 4, "tree_depth": 5})

Built by `jaxinfer.engine.build` (`load_eagle3_weights`); refused by name there: tensor or
sequence parallelism (the head's weights and pool are not split), and targets with sliding-window,
chunked or linear-attention layers (the head reads its K/V at the target's page ids, which those
give back as the window moves).
"""

from __future__ import annotations

from jaxinfer.engine.stream_proposer import StreamChainProposer


class Eagle3Proposer(StreamChainProposer):
    """An EAGLE-3 head as a `StreamChainProposer` (its runner returns its own pre-norm output);
    `tree`, `tree_top_k`, `tree_depth`: the speculative_config's, for draft trees."""
