"""Beam search as a mode of the engine: `LLM.beam_search(prompts, BeamSearchParams(beam_width=4))`.

Each round submits every live beam of every prompt to the engine as a one-token request asking
for its top 2 x beam_width next-token log-probabilities; the beams share their prefixes
through the prefix cache, so a round recomputes at most a partial page per beam. Candidates are
ranked by cumulative log-probability; a candidate ending in EOS retires to the finished list
(unless ignore_eos). At the end, finished and live beams are ranked by
cumulative_logprob / length ** length_penalty, HF's length normalization.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.sampling_params import SamplingParams


@dataclasses.dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: object = None  # refused: see __post_init__

    def __post_init__(self):
        if self.structured_outputs is not None:
            raise ValueError(
                "BeamSearchParams.structured_outputs: beam search cannot be constrained here (beams grow from each "
                "position's top logprobs, which the grammar mask does not touch); use SamplingParams(n=..., "
                "structured_outputs=...) for several constrained completions"
            )
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r}: must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r}: must be an integer >= 1")


@dataclasses.dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens (prompt excluded)
    cumulative_logprob: float
    text: str = ""
    finished: bool = False  # ended with EOS

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(len(self.token_ids), 1) ** length_penalty


@dataclasses.dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first


def beam_search(llm, prompts: Sequence, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.engine
    W = params.beam_width
    if 2 * W > engine.config.max_logprobs:
        raise ValueError(f"BeamSearchParams.beam_width={W}: needs max_logprobs >= {2 * W} (the engine has {engine.config.max_logprobs})")
    prompt_ids = []
    for i, prompt in enumerate(prompts):
        _, ids = engine.tokenize(prompt, f"prompt {i}")
        engine.validate(ids, SamplingParams(max_tokens=params.max_tokens), f"prompt {i}")
        prompt_ids.append(ids)
    live = [[BeamSequence([], 0.0)] for _ in prompts]
    done: list[list[BeamSequence]] = [[] for _ in prompts]
    step = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * W)

    for _ in range(params.max_tokens):
        owners = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not owners:
            break
        outs = llm.generate([prompt_ids[i] + beam.token_ids for i, beam in owners], step, use_tqdm=False)
        candidates: list[list[BeamSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(owners, outs):
            for token, lp in out.outputs[0].logprobs[0].items():
                candidates[i].append(BeamSequence(beam.token_ids + [token], beam.cumulative_logprob + lp.logprob))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda b: b.cumulative_logprob, reverse=True)
            keep = []
            for cand in cands:
                if len(keep) == W:
                    break
                if not params.ignore_eos and cand.token_ids[-1] in engine.eos_token_ids:
                    cand.finished = True
                    if len(done[i]) < W:
                        done[i].append(cand)
                else:
                    keep.append(cand)
            live[i] = keep

    results = []
    for i in range(len(prompts)):
        ranked = sorted(done[i] + live[i], key=lambda b: b.score(params.length_penalty), reverse=True)[:W]
        for beam in ranked:
            ids = beam.token_ids[:-1] if beam.finished else beam.token_ids
            beam.text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        results.append(BeamSearchOutput(prompt_ids[i], ranked))
    return results
