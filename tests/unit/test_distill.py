"""On-policy distillation in the update (rl.distill_coef, rl.distill_only): each token's
advantage takes the teacher's term, coef * (teacher log-prob - engine log-prob) of the sampled
token, on top of the group's advantage or alone; records without the teacher's log-probs are
refused; and an update on the demo model moves the student toward the teacher."""

import json
import math

import pytest
import torch

from orchestrator.train import grpo
from orchestrator.train.batches import check_teacher_logprobs
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.request import TrainRequest
from orchestrator.train.settings import UpdateSettings

ENGINE = [-0.5, -1.0, -2.0]
TEACHER = [-0.25, -2.0, -1.0]


def _record(**first) -> grpo.Record:
    """Two samples of three tokens (rewards 1 and 0: group advantages about +1 and -1), each
    with the engine's and the teacher's log-probs; ``first`` updates the first sample."""
    samples = [{"text": "a", "token_ids": [7, 8, 2], "reward": 1.0, "finish_reason": "stop", "logprobs": ENGINE,
                "teacher_logprobs": TEACHER, **first},
               {"text": "b", "token_ids": [9, 9, 2], "reward": 0.0, "finish_reason": "stop", "logprobs": [-1.0, -1.0, -1.0],
                "teacher_logprobs": [-1.5, -0.5, -1.0]}]
    return grpo.parse_record(json.loads(json.dumps({"task_id": "t7", "prompt": "q", "prompt_token_ids": [1, 5], "samples": samples})))


def test_each_tokens_advantage_is_the_groups_plus_the_teachers_term():
    plain = grpo.encode_record(None, _record())
    completions = grpo.encode_record(None, _record(), distillation=grpo.Distillation(0.5))
    a, b = (c.advantage for c in plain)
    assert a == pytest.approx(1.0, abs=1e-5) and b == pytest.approx(-1.0, abs=1e-5)
    assert [c.advantage for c in completions] == [a, b], "the group's advantage is kept"
    expected = [a + 0.5 * (q - s) for s, q in zip(ENGINE, TEACHER)] + [b + 0.5 * d for d in (-0.5, 0.5, 0.0)]
    assert expected[:3] == pytest.approx([a + 0.125, a - 0.5, a + 0.5])
    for batch in (grpo.collate(completions, pad_id=0), grpo.collate_rows([completions], pad_id=0)):  # padded, packed
        assert batch.advantages.tolist() == pytest.approx(expected)
    assert grpo.collate(plain, pad_id=0).advantages.tolist() == pytest.approx([a] * 3 + [b] * 3), "coef 0: as before"


def test_distill_only_leaves_the_reward_out_of_the_advantage():
    completions = grpo.encode_record(None, _record(), distillation=grpo.Distillation(2.0, only=True))
    assert [c.advantage for c in completions] == [0.0, 0.0]
    assert grpo.collate(completions, pad_id=0).advantages.tolist() == pytest.approx([0.5, -2.0, 2.0, -1.0, 1.0, 0.0])


def test_overlong_penalty_shapes_only_the_rewards_term():
    """The penalty moves the group's advantages; with distill_only there is no reward term for it to move."""
    cut = {"finish_reason": "length", "token_ids": [7, 8, 8, 8], "logprobs": ENGINE + [-1.0], "teacher_logprobs": TEACHER + [-1.0]}
    shaping = grpo.Shaping("penalty", max_tokens=4, buffer=2)
    alone = grpo.encode_record(None, _record(**cut), "dr_grpo", shaping, grpo.Distillation(1.0, only=True))
    assert grpo.collate(alone, pad_id=0).advantages.tolist() == pytest.approx([0.25, -1.0, 1.0, 0.0, -0.5, 0.5, 0.0])
    both = grpo.encode_record(None, _record(**cut), "dr_grpo", shaping, grpo.Distillation(1.0))
    shaped = [0.25, -0.25]  # rewards 1 - 1 (4 tokens, at the limit) and 0 - 0.5 (3 tokens): 0.5 apart, not 1
    assert [c.advantage for c in both] == pytest.approx(shaped)
    assert grpo.collate(both, pad_id=0).advantages.tolist() == pytest.approx([0.5, -0.75, 1.25, 0.25, -0.75, 0.25, -0.25])


def test_a_token_out_of_the_loss_takes_no_teachers_term_and_stays_out_of_the_loss():
    completions = grpo.encode_record(None, _record(loss_mask=[1, 0, 1], logprobs=[-0.5, 0.0, -2.0], teacher_logprobs=[-0.25, 0.0, -1.0]),
                                     distillation=grpo.Distillation(1.0))
    a = completions[0].advantage
    batch = grpo.collate(completions, pad_id=0)
    assert batch.advantages[:3].tolist() == pytest.approx([a + 0.25, a, a + 1.0])
    assert batch.mask.tolist() == [1, 0, 1, 1, 1, 1]
    assert grpo.token_advantages(0.3, [-1.0, -9.0], [-2.0, -1.0], (1, 0), grpo.Distillation(1.0)) == pytest.approx((-0.7, 0.3))


def test_an_agents_earlier_segment_takes_its_samples_advantage_and_its_own_teachers_terms():
    segment = {"prompt_token_ids": [1, 9], "token_ids": [4, 4, 2], "logprobs": [-1.0, 0.0, -1.0], "loss_mask": [1, 0, 1],
               "teacher_logprobs": [-0.5, 0.0, -3.0]}
    first, second, seg = grpo.encode_record(None, _record(segments=[segment]), distillation=grpo.Distillation(1.0))
    assert seg.prompt_ids == (1, 9) and seg.advantage == first.advantage
    assert seg.token_advantages == pytest.approx((first.advantage + 0.5, first.advantage, first.advantage - 2.0))
    only = grpo.encode_record(None, _record(segments=[segment]), distillation=grpo.Distillation(1.0, only=True))
    batch = grpo.collate_rows([[only[0], only[2]], [only[1]]], pad_id=0)  # packed: the segment after its sample in a row
    assert batch.advantages.tolist() == pytest.approx([0.25, -1.0, 1.0, 0.5, 0.0, -2.0, -0.5, 0.5, 0.0])


def test_the_mean_reverse_kl_counts_the_trained_tokens_only():
    completions = grpo.encode_record(None, _record(loss_mask=[1, 0, 1], logprobs=[-0.5, 0.0, -2.0], teacher_logprobs=[-0.25, 0.0, -1.0]),
                                     distillation=grpo.Distillation(1.0))
    # (-0.25 - 1.0) over the first's 2 trained tokens, (0.5 - 0.5 + 0.0) over the second's 3
    assert grpo.mean_reverse_kl(completions) == pytest.approx(-1.25 / 5)
    cut = grpo.encode_record(None, _record(finish_reason="length"), shaping=grpo.Shaping("mask", max_tokens=3, buffer=1),
                             distillation=grpo.Distillation(1.0))
    assert not cut[0].trained and grpo.mean_reverse_kl(cut) == pytest.approx(0.0), "an untrained sample counts for nothing"
    no_teacher = grpo.parse_record({"task_id": "u", "prompt": "q", "prompt_token_ids": [1],
                                    "samples": [{"text": "a", "token_ids": [2], "reward": 0, "finish_reason": "stop"}]})
    assert grpo.mean_reverse_kl(grpo.encode_record(None, no_teacher)) is None


# --- records without the teacher's log-probs ------------------------------------------------


@pytest.mark.parametrize("first, where", [
    ({"teacher_logprobs": None}, "sample 0"),
    ({"teacher_logprobs": [-1.0, -1.0]}, "sample 0"),  # one short: none that fit
    ({"teacher_logprobs": [-1.0, float("nan"), -1.0]}, "sample 0"),
    ({"segments": [{"prompt_token_ids": [1], "token_ids": [4], "logprobs": [-1.0]}]}, "sample 0 segment 0"),
])
def test_a_record_without_the_teachers_logprobs_is_refused_naming_the_task_and_the_keys(first, where):
    record = _record(**first)
    with pytest.raises(BadTrainInput) as refused:
        check_teacher_logprobs([_record(), record], 0.5)
    message = str(refused.value)
    assert f"trajectory record t7 {where} has no teacher_logprobs" in message
    assert "rl.distill_coef=0.5" in message and "rl.teacher" in message and "rl.distill_coef=0" in message
    with pytest.raises(ValueError, match=f"record t7 {where} lacks the engine's or the teacher's log-probs"):
        grpo.encode_record(None, record, distillation=grpo.Distillation(0.5))


def test_distillation_needs_the_engines_logprobs_too():
    raw = {"iteration": 1, "data": "/r/a.jsonl", "init_checkpoint": "/r/c", "reference_checkpoint": None, "output": "/r/o",
           "seed": 1, "rl": {"distill_coef": 0.5}}
    assert TrainRequest.from_json(raw).engine_logprobs_needed == "distill_coef=0.5"
    assert TrainRequest.from_json({**raw, "rl": {}}).engine_logprobs_needed is None


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("settings, complaint", [
    ({"distill_only": True}, "rl.distill_only makes the teacher's term the whole advantage, and rl.distill_coef=0 gives it no "
                             "weight: set rl.distill_coef > 0"),
    ({"distill_only": True, "distill_coef": 1.0, "filter_groups": True}, "set rl.filter_groups=false"),
])
def test_the_distillation_keys_rules(settings, complaint):
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        UpdateSettings(**settings).check()
    UpdateSettings(distill_coef=0.5).check()
    UpdateSettings(distill_coef=0.5, distill_only=True).check()


def test_a_negative_distill_coef_is_refused_naming_the_key():
    raw = {"iteration": 1, "data": "/r/a.jsonl", "init_checkpoint": "/r/c", "reference_checkpoint": None, "output": "/r/o",
           "seed": 1, "rl": {"distill_coef": -0.1}}
    with pytest.raises(ValueError, match="rl.distill_coef"):
        TrainRequest.from_json(raw)


# --- an update on the demo model ----------------------------------------------------------


def _sampled(model, prompts: list[list[int]], samples: int, tokens: int, generator) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) pairs, each completion sampled from ``model`` token by token."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt] * samples)
            for _ in range(tokens):
                logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
                ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)], 1)
            out += [(prompt, row[len(prompt):]) for row in ids.tolist()]
    return out


def _reverse_kl(student, teacher, prompts: list[list[int]]) -> float:
    """KL(student || teacher) of the next token after each prompt, exactly (the whole
    vocabulary), averaged over the prompts."""
    with torch.no_grad():
        total = 0.0
        for prompt in prompts:
            ids = torch.tensor([prompt])
            s = student(input_ids=ids, use_cache=False).logits[0, -1].float().log_softmax(-1)
            q = teacher(input_ids=ids, use_cache=False).logits[0, -1].float().log_softmax(-1)
            total += (s.exp() * (s - q)).sum().item()
    return total / len(prompts)


def test_an_update_with_distill_only_moves_the_student_toward_the_teacher():
    """On-policy: each round samples from the student, records the student's (the engine's)
    and the teacher's log-probs of the sampled tokens, rewards all 0, and takes two
    optimizer steps of the GRPO loss on those records with rl.distill_only; the exact reverse
    KL to the teacher falls, and so does the sampled estimate the update reports."""
    from orchestrator.demo import model as demo_model
    from orchestrator.demo import tokenizer as demo_tokenizer

    student, teacher = demo_model.create(0), demo_model.create(1)
    student.eval(), teacher.eval()
    with torch.no_grad():  # freshly made, both answer almost uniformly: a peaked teacher is one to learn from
        teacher.get_output_embeddings().weight.mul_(30)
    tokenizer = demo_tokenizer.build()
    prompts = [tokenizer.encode(f"{a}+{b}=").ids for a, b in ((12, 3), (40, 40), (7, 75), (31, 9))]
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    before = _reverse_kl(student, teacher, prompts)
    estimates = []
    for _ in range(4):
        pairs = _sampled(student, prompts, samples=8, tokens=3, generator=generator)
        bare = [grpo.Completion(tuple(p), tuple(c), 0.0) for p, c in pairs]
        with torch.no_grad():
            engine = grpo.completion_logprobs(student, grpo.collate(bare, pad_id=0)).split(3)
            taught = grpo.completion_logprobs(teacher, grpo.collate(bare, pad_id=0)).split(3)
        samples = [grpo.Sample("", 0.0, "length", tuple(c), tuple(e.tolist()), teacher_logprobs=tuple(q.tolist()))
                   for (_, c), e, q in zip(pairs, engine, taught)]
        records = [grpo.Record(f"t{k}", "", tuple(samples[8 * k: 8 * k + 8]), tuple(p)) for k, p in enumerate(prompts)]
        completions = [c for r in records for c in grpo.encode_record(None, r, distillation=grpo.Distillation(1.0, only=True))]
        estimates.append(grpo.mean_reverse_kl(completions))
        batch = grpo.collate(completions, pad_id=0)
        old = torch.cat(engine)
        for _ in range(2):
            optimizer.zero_grad()
            new = grpo.completion_logprobs(student, batch)
            grpo.grpo_loss(new, old, batch.advantages, clip_eps=0.2, lengths=batch.lengths).loss.backward()
            optimizer.step()
    after = _reverse_kl(student, teacher, prompts)
    assert before > 1.0 and after < 0.8 * before, (before, after)  # measured 5.51 -> 3.56
    assert estimates[-1] < estimates[0] and all(math.isfinite(e) for e in estimates), estimates
