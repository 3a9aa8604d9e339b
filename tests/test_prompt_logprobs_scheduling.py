"""Where the scheduler starts a request collecting prompt logprobs, whatever the cache holds.

Each prompt token gets exactly one entry (entry 0, the first token's, is None), so such a request
takes K/V from cache (prefix-cache pages, or its own pages swapped out) only for the tokens
before the row that scores its first missing entry: a fresh one computes its whole prompt, a
preempted one resumes where its entries stop. The prompt's pages are cached here by a twin
that computed the same prompt before. (The values themselves are checked end to end in
test_llm_api.py and test_lora.py.)
"""

from __future__ import annotations

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.request import Request, Sequence, SwappedKV
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler
from jaxinfer.engine.step_plan import plan_chunk
from jaxinfer.outputs import Logprob
from jaxinfer.sampling_params import SamplingParams

PS = 4
PROMPT = list(range(10, 50))  # 40 tokens: 9 full pages before the last one
EOS = {2}


def admit(prompt_logprobs: int | None, *, entries: int = 1, swapped: int | None = None) -> tuple[ScheduledSeq, Scheduler]:
    """Schedules a request for PROMPT (with `entries` prompt logprobs recorded already, and its
    first `swapped` tokens' K/V saved to host memory) once the twin's pages are cached."""
    bm = BlockManager(num_pages=64, page_size=PS)
    bm.allocate("twin", PROMPT)
    bm.mark_computed("twin", len(PROMPT), PROMPT)
    bm.free("twin")
    request = Request("r", None, list(PROMPT), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs),
                      seed=0, max_len=len(PROMPT) + 4)
    if entries > 1:
        request.prompt_logprobs = [None] + [{PROMPT[i]: Logprob(-1.0, 1, "")} for i in range(1, entries)]
    seq = Sequence(request, 0, list(PROMPT), seed=0)
    if swapped is not None:
        seq.swapped = SwappedKV(pages=None, num_computed=swapped)
    request.seqs.append(seq)
    scheduler = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    scheduler.add(seq)
    return scheduler.schedule().scheduled[0], scheduler


def scored_tokens(s: ScheduledSeq, scheduler: Scheduler) -> list[int]:
    """The prompt tokens whose logprobs the planned chunk's rows report, in order."""
    chunk = plan_chunk(s, *scheduler.block_manager.held_rows(s.seq.seq_id), EOS)
    return [t for t in chunk.sampling.target_ids if t >= 0]


def test_without_prompt_logprobs_the_cached_prefix_is_reused():
    s, _ = admit(None)
    assert s.start == 36


def test_a_fresh_request_collecting_prompt_logprobs_computes_its_whole_prompt():
    s, scheduler = admit(1)
    assert s.start == 0 and s.num_tokens == 40
    assert s.seq.request.prompt_logprobs == [None]
    assert scored_tokens(s, scheduler) == PROMPT[1:]


def test_a_preempted_request_resumes_where_its_entries_stop():
    """18 entries recorded (tokens 0..17): the row of position 17 scores the next one, so 17
    tokens may come from cache, in whole pages: 16."""
    s, scheduler = admit(1, entries=18)
    assert s.start == 16
    assert scored_tokens(s, scheduler) == PROMPT[18:]  # position 16's row scored token 17 already: no duplicate


def test_a_request_with_every_entry_recorded_reuses_the_cache_again():
    s, _ = admit(1, entries=40)  # preempted after its prompt: a recompute needs no rows
    assert s.start == 36


def test_swapped_out_pages_are_restored_no_further_than_the_entries():
    s, scheduler = admit(1, entries=18, swapped=30)
    assert s.start == 17
    assert scored_tokens(s, scheduler) == PROMPT[18:]
    s, _ = admit(None, swapped=38)  # without prompt logprobs: all it saved
    assert s.start == 38
