"""The embedded engine batches across requests: rows of a request that arrives while others
decode join the running batch and get what they would get alone; each request keeps its own
settings and random stream; padding does not outlive the rows that needed it; the scheduler
admits in order, runs a reload only on an empty batch, and keeps errors with their request.

Tiny random-weight models of both demo architectures (Llama, Qwen2), float32, in-process.
Sequences of different requests in one batch see logits that may differ from the ones they
would see alone in the last float bits (batch shapes change the kernels' blocking): tokens
are compared exactly, logprobs within 1e-5.
"""

from __future__ import annotations

import threading

import pytest

from orchestrator.engine import scheduler as sch
from orchestrator.engine.sampling import Batch, EmptyPrompt, FinishReason, PromptTooLong, Sampler, SamplingParams
from orchestrator.engine.scheduler import EngineStopped, GenerationJob, Scheduler, admissions

WAIT_S = 30.0  # bound on every wait for the scheduler thread
ARITH = ["1+2=", "12+34=", "49+49=", "7*8=", "", "3-1=0+99*2="]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from orchestrator.demo import model, tokenizer

    return model.create(0), tokenizer.save(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def qwen2():
    from orchestrator.demo import chat_tokenizer, model, tasks, warm_start

    tok = chat_tokenizer.fast(chat_tokenizer.corpus(tasks.make_tasks(0, chat=True)["train"][:200], warm_start.CHAT.target))
    return model.create_chat(0, tok), tok


def _chat_prompts(tok) -> list[str]:
    questions = ["What is 1+2?", "What is 12+34? Put the answer in \\boxed{}.", "Hi", "What is 49+49?"]
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    """(sampler, prompts) for each demo architecture; EOS never ends a row, so that rows run
    to max_tokens and the batch stays busy for as long as a test needs."""
    model, tok = request.getfixturevalue(request.param)
    sampler = Sampler(model, tok)
    sampler.eos_ids = frozenset()
    return sampler, ARITH if request.param == "llama" else _chat_prompts(tok)


def _same(got, alone) -> None:
    assert got.prompt_token_ids == alone.prompt_token_ids
    for g, a in zip(sum(got.samples, []), sum(alone.samples, []), strict=True):
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (a.text, a.token_ids, a.finish_reason, a.stop_reason)
        assert g.token_logprobs == pytest.approx(a.token_logprobs, abs=1e-5)


def _run(sampler: Sampler, batch: Batch, requests) -> None:
    while any(r.generation is None for r in requests):
        sampler.step(batch)


# --- the sampler: joining, leaving, per-request settings --------------------------------------


def test_a_request_that_joins_a_running_batch_gets_what_it_gets_alone(arch):
    sampler, prompts = arch
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5, logprobs=2)
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=9)
    alone_seeded = sampler.generate(prompts[:2], seeded)
    alone_greedy = sampler.generate(prompts[2:4], greedy)

    first, second = sampler.request(prompts[:2], seeded), sampler.request(prompts[2:4], greedy)
    batch = Batch()
    batch.join(sampler.prefill([first]))
    for _ in range(3):
        sampler.step(batch)
    batch.join(sampler.prefill([second]))  # its prompts are longer or shorter: one side is left-padded
    assert len(batch) == 4 + 6
    _run(sampler, batch, [first, second])

    _same(first.generation, alone_seeded)
    _same(second.generation, alone_greedy)
    assert first.generation.peak_batch_requests == second.generation.peak_batch_requests == 2
    assert len(batch) == 0 and batch.cache is None


def test_a_seeded_request_draws_from_its_own_generator_whatever_shares_the_batch(arch):
    sampler, prompts = arch
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1234)
    alone = sampler.request(prompts[:1], params)
    batch = Batch()
    batch.join(sampler.prefill([alone]))
    _run(sampler, batch, [alone])

    # Alongside an unseeded request (the shared generator) and another seeded one, before and after it.
    neighbours = [sampler.request(prompts[1:3], SamplingParams(n=2, temperature=0.8)),
                  sampler.request(prompts[3:], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=6))]
    shared = sampler.request(prompts[:1], params)
    batch.join(sampler.prefill([neighbours[0], shared, neighbours[1]]))
    _run(sampler, batch, [shared, *neighbours])

    _same(shared.generation, alone.generation)
    # The same draws, in the same order: the generators end in the same state.
    assert bool((shared.generator.get_state() == alone.generator.get_state()).all())


def test_requests_with_the_same_prompt_are_prefilled_once_and_each_gets_what_it_gets_alone(arch):
    """A group's samples sent one request each (agents through the endpoint) share one prefill
    row, as vLLM's prefix cache shares their prompt; a scoring request's prompts all run."""
    sampler, prompts = arch
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=s) for s in (1, 2)] + [SamplingParams(temperature=0, max_tokens=8)]
    alone = [sampler.generate(prompts[:1], p) for p in params] + [sampler.generate(prompts[1:2], params[2])]
    requests = [sampler.request(prompts[:1], p) for p in params] + [sampler.request(prompts[1:2], params[2])]
    forwarded = []
    hook = sampler.model.register_forward_pre_hook(lambda module, args, kwargs: forwarded.append(kwargs["input_ids"].shape[0]),
                                                   with_kwargs=True)
    try:
        batch, counted = Batch(), (sampler.prompt_tokens, sampler.prefill_tokens)
        batch.join(sampler.prefill(requests))
        assert forwarded == [2], "two distinct prompts: two rows in the prefill's forward pass"
        assert len(batch) == 2 + 2 + 1 + 1
        lengths = [len(sampler.encode(p)) for p in prompts[:2]]
        assert (sampler.prompt_tokens - counted[0], sampler.prefill_tokens - counted[1]) == (5 * lengths[0] + lengths[1], sum(lengths))
        _run(sampler, batch, requests)
        scoring = [sampler.request(prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=0)) for _ in range(2)]
        sampler.prefill(scoring)
        assert forwarded[-1] == 2, "each scored prompt on a row of its own"
    finally:
        hook.remove()
    for got, want in zip(requests, alone, strict=True):
        _same(got.generation, want)


def test_finished_rows_leave_at_once_and_padding_no_row_needs_is_cropped(llama):
    model, tok = llama
    sampler = Sampler(model, tok)
    sampler.eos_ids = frozenset()
    long_prompt, short_prompt = "1+2+3+4+5+6+7+8+9+10=", "1="
    short = sampler.request([short_prompt], SamplingParams(temperature=0, max_tokens=12))
    long = sampler.request([long_prompt], SamplingParams(n=2, temperature=0, max_tokens=3))
    batch = Batch()
    batch.join(sampler.prefill([short]))
    sampler.step(batch)
    batch.join(sampler.prefill([long]))  # the short row is left-padded to the long prompt's width
    assert batch.width == len(sampler.encode(long_prompt)) and not bool(batch.mask[0].all())
    for _ in range(3):
        finished = sampler.step(batch)
    assert finished == [long] and len(batch) == 1, "the long request's rows left in the step they ended"
    # Only the short row is left: none of its columns is padding any more.
    assert bool(batch.mask.all())
    assert batch.width == len(sampler.encode(short_prompt)) + len(short.rows[0].token_ids)
    assert all(layer.keys.shape[0] == 1 and layer.keys.shape[2] == batch.width for layer in batch.cache.layers)
    _run(sampler, batch, [short])
    _same(short.generation, sampler.generate([short_prompt], short.params))


def test_each_request_keeps_its_own_settings_in_a_shared_batch(llama):
    model, tok = llama
    sampler = Sampler(model, tok)
    prompts = ARITH[:3]
    greedy = sampler.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=3))
    greedy_text = greedy.samples[1][0].text
    assert len(greedy_text) >= 2, "the test needs a greedy continuation with at least two characters"
    requests = [
        sampler.request(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=3)),
        # top_p so small that only the most likely token is left: greedy, through the sampling path
        sampler.request(prompts, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_tokens=8, seed=3)),
        sampler.request(prompts[1:2], SamplingParams(temperature=0, max_tokens=8, stop=(greedy_text[1],), logprobs=0)),
        sampler.request(prompts, SamplingParams(n=3, temperature=1.5, max_tokens=2)),
    ]
    batch = Batch()
    batch.join(sampler.prefill(requests))
    _run(sampler, batch, requests)
    as_greedy, nucleus, stopped, short = (r.generation for r in requests)

    _same(as_greedy, greedy)
    assert all(len(s.top_logprobs[0]) == 3 for g in as_greedy.samples for s in g)
    for j, group in enumerate(nucleus.samples):
        for s in group:
            assert s.token_ids == greedy.samples[j][0].token_ids and s.top_logprobs is None
    [[cut]] = stopped.samples
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (greedy_text[:1], FinishReason.STOP, greedy_text[1])
    assert all(lp == [] for lp in cut.top_logprobs)
    assert all(len(s.token_ids) <= 2 for g in short.samples for s in g) and all(len(g) == 3 for g in short.samples)


def test_a_prompt_without_tokens_is_refused_before_it_reaches_the_batch(qwen2):
    sampler = Sampler(*qwen2)  # the chat tokenizer adds no BOS: "" has no token
    with pytest.raises(EmptyPrompt, match="prompt 1 has no token"):
        sampler.request(["Hi", ""], SamplingParams())


def test_a_model_with_sliding_window_layers_is_refused(qwen2):
    from transformers import Qwen2ForCausalLM

    model, tok = qwen2
    config = model.config.to_dict() | {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                                        "layer_types": None}
    sliding = Qwen2ForCausalLM(type(model.config)(**config))
    with pytest.raises(ValueError, match="sliding_attention"):
        Sampler(sliding, tok)


# --- admission: a pure function of the queue ---------------------------------------------------


def test_requests_join_in_arrival_order_while_they_fit():
    assert admissions([8, 8, 8], running=0, max_num_seqs=16) == 2
    assert admissions([8, 8, 8], running=8, max_num_seqs=16) == 1
    assert admissions([4, 12, 1], running=4, max_num_seqs=16) == 1, "a small request does not pass a large one"
    assert admissions([], running=3, max_num_seqs=16) == 0


def test_a_request_larger_than_the_limit_joins_an_empty_batch_alone():
    assert admissions([64, 1], running=0, max_num_seqs=16) == 1
    assert admissions([64], running=1, max_num_seqs=16) == 0


def test_no_request_joins_past_a_call_between_steps():
    assert admissions([2, None, 2], running=0, max_num_seqs=16) == 1
    assert admissions([None, 2], running=0, max_num_seqs=16) == 0


# --- the scheduler thread ----------------------------------------------------------------------


class PausingSampler(Sampler):
    """Stops before its ``pause_at``-th step until the test releases it, so that a test
    submits work at a known point of the batch's life."""

    def __init__(self, model, tokenizer, pause_at: int):
        super().__init__(model, tokenizer)
        self.eos_ids = frozenset()
        self.pause_at = pause_at
        self.steps = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def step(self, batch):
        self.steps += 1
        if self.steps == self.pause_at:
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test did not release the step"
        return super().step(batch)


@pytest.fixture
def paused(llama):
    """A running scheduler whose sampler pauses before its 2nd step."""
    sampler = PausingSampler(*llama, pause_at=2)
    scheduler = Scheduler(sampler, max_num_seqs=64)
    scheduler.start()
    yield scheduler, sampler
    sampler.release.set()
    scheduler.stop(WAIT_S)


def _wait(event: threading.Event) -> None:
    assert event.wait(WAIT_S), f"not reached within {WAIT_S}s"


@pytest.mark.timeout(60)
def test_a_request_submitted_while_another_decodes_joins_the_running_batch(paused, llama):
    scheduler, sampler = paused
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7, logprobs=0)
    running = scheduler.submit(GenerationJob(ARITH[:2], SamplingParams(temperature=0, max_tokens=20)))
    _wait(sampler.reached)
    joining = scheduler.submit(GenerationJob(ARITH[2:4], params))
    sampler.release.set()

    got = joining.result(WAIT_S)
    assert got.peak_batch_requests == 2 and running.result(WAIT_S).peak_batch_requests == 2
    stats = scheduler.stats()
    assert (stats.requests, stats.joined_running, stats.peak_requests, stats.peak_sequences) == (2, 1, 2, 6)
    alone = Sampler(*llama)
    alone.eos_ids = frozenset()
    _same(got, alone.generate(ARITH[2:4], params))


@pytest.mark.timeout(60)
def test_a_call_between_steps_runs_on_an_empty_batch_and_before_later_requests(paused):
    scheduler, sampler = paused
    before = scheduler.submit(GenerationJob(ARITH[:1], SamplingParams(temperature=0, max_tokens=6)))
    _wait(sampler.reached)
    seen = {}

    def call():
        seen["before_done"], seen["after_done"] = before.done(), after.done()
        return "reloaded"

    between = scheduler.between_steps(call)
    after = scheduler.submit(GenerationJob(ARITH[1:2], SamplingParams(temperature=0, max_tokens=6)))
    sampler.release.set()

    assert between.result(WAIT_S) == "reloaded"
    assert seen == {"before_done": True, "after_done": False}
    assert after.result(WAIT_S).peak_batch_requests == 1 and before.result().peak_batch_requests == 1


class _Refused(Exception):
    pass


@pytest.mark.timeout(60)
def test_a_refused_too_long_or_unanswerable_request_fails_alone(paused):
    scheduler, sampler = paused
    running = scheduler.submit(GenerationJob(ARITH[:2], SamplingParams(n=2, temperature=0, max_tokens=12)))
    _wait(sampler.reached)

    class RefusedAtAdmission(GenerationJob):
        def admit(self):
            raise _Refused("the served model changed")

    class FailsToFinish(GenerationJob):
        def finish(self, generation):
            raise _Refused("cannot build the response")

    refused = scheduler.submit(RefusedAtAdmission(ARITH[:1], SamplingParams()))
    too_long = scheduler.submit(GenerationJob(["1+1=", "9" * 70], SamplingParams(max_tokens=1)))
    unanswerable = scheduler.submit(FailsToFinish(ARITH[:1], SamplingParams(max_tokens=3)))
    fine = scheduler.submit(GenerationJob(ARITH[2:3], SamplingParams(max_tokens=3)))
    sampler.release.set()

    with pytest.raises(_Refused, match="served model changed"):
        refused.result(WAIT_S)
    with pytest.raises(PromptTooLong, match="maximum context length is 64 tokens"):
        too_long.result(WAIT_S)
    with pytest.raises(_Refused, match="cannot build the response"):
        unanswerable.result(WAIT_S)
    assert len(fine.result(WAIT_S).samples) == 1
    assert [len(s.token_ids) for g in running.result(WAIT_S).samples for s in g] == [12] * 4


@pytest.mark.timeout(60)
def test_stopping_answers_running_and_queued_requests_with_engine_stopped(paused):
    scheduler, sampler = paused
    running = scheduler.submit(GenerationJob(ARITH[:1], SamplingParams(max_tokens=20)))
    _wait(sampler.reached)
    queued = scheduler.submit(GenerationJob(ARITH[1:2], SamplingParams(max_tokens=20)))
    stopper = threading.Thread(target=scheduler.stop, args=(WAIT_S,))
    stopper.start()
    sampler.release.set()
    stopper.join(WAIT_S)
    for future in (running, queued):
        with pytest.raises(EngineStopped, match="shutting down"):
            future.result(WAIT_S)
    with pytest.raises(EngineStopped):
        scheduler.submit(GenerationJob(ARITH[:1], SamplingParams()))


@pytest.mark.timeout(60)
def test_a_failed_step_fails_the_requests_in_the_batch_and_the_scheduler_serves_on(llama, monkeypatch):
    sampler = Sampler(*llama)
    scheduler = Scheduler(sampler, max_num_seqs=64)
    scheduler.start()
    try:
        real_step = Sampler.step
        monkeypatch.setattr(sampler, "step", lambda batch: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            scheduler.submit(GenerationJob(ARITH[:2], SamplingParams(max_tokens=4))).result(WAIT_S)
        monkeypatch.setattr(sampler, "step", lambda batch: real_step(sampler, batch))
        assert len(scheduler.submit(GenerationJob(ARITH[:2], SamplingParams(max_tokens=4))).result(WAIT_S).samples) == 2
    finally:
        scheduler.stop(WAIT_S)


def test_max_num_seqs_must_be_positive(llama):
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        sch.Scheduler(Sampler(*llama), max_num_seqs=0)
