"""The GRPO pieces as pure functions: advantages, batching, log-probs, loss (the split over
workers and steps: test_plan.py)."""

import json
import math
import re

import pytest
import torch

from orchestrator.train import grpo


def _completion(prompt, completion, advantage=0.0):
    return grpo.Completion(tuple(prompt), tuple(completion), advantage)


# --- advantages ----------------------------------------------------------------------------


def test_advantages_are_normalised_within_the_group():
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_advantages_use_the_population_std():
    rewards = [0.0, 1.0, 3.0]
    mean = sum(rewards) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    assert grpo.group_advantages(rewards) == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])


@pytest.mark.parametrize("rewards", [[0.0, 0.0, 0.0], [1.0, 1.0], [0.1, 0.1, 0.1], [0.7]])
def test_advantages_are_exactly_zero_when_rewards_are_all_equal(rewards):
    assert grpo.group_advantages(rewards) == [0.0] * len(rewards)


# --- records -------------------------------------------------------------------------------


def test_records_keep_file_order_and_ignore_unknown_keys(tmp_path):
    path = tmp_path / "agg.jsonl"
    lines = [
        {"task_id": "b", "prompt": "1+1=", "answer": "2", "extra": 1, "samples": [{"text": "2", "reward": 1, "finish_reason": "stop", "logprobs": None}]},
        {"task_id": "a", "prompt": "2+2=", "answer": "4", "samples": [{"text": "44", "reward": 0.0, "finish_reason": "length", "logprobs": [-0.1, -0.2]}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    records = grpo.read_records(path)
    assert [r.task_id for r in records] == ["b", "a"]
    assert records[0].samples == (grpo.Sample("2", 1.0, "stop"),)
    assert records[1].samples[0].finish_reason == "length"


@pytest.mark.parametrize(
    "line, complaint",
    [
        ("{not json", "bad trajectory record"),
        ('{"task_id": "a", "prompt": "1+1=", "samples": []}', "'samples' must be a non-empty list"),
        ('{"task_id": "a", "prompt": "1+1=", "samples": [{"text": "2", "reward": "1", "finish_reason": "stop"}]}', "reward must be a finite number"),
        ('{"task_id": "a", "prompt": "1+1=", "samples": [{"text": "2", "reward": 1, "finish_reason": "abort"}]}', "finish_reason must be one of"),
        ('{"prompt": "1+1=", "samples": [{"text": "2", "reward": 1, "finish_reason": "stop"}]}', "'task_id' must be a string"),
    ],
)
def test_a_bad_record_is_reported_with_file_and_line(tmp_path, line, complaint):
    path = tmp_path / "agg.jsonl"
    good = '{"task_id": "z", "prompt": "0+0=", "samples": [{"text": "0", "reward": 1, "finish_reason": "stop"}]}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=complaint) as e:
        grpo.read_records(path)
    assert f"{path}:2:" in str(e.value)


# --- batching ------------------------------------------------------------------------------


class _CharTokenizer:
    """Enough of a Hugging Face tokenizer for encode_record: <s>=1, </s>=2, digit d = 10 + d."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        def ids(t):
            return ([1] if add_special_tokens else []) + [10 + int(ch) for ch in t]

        return {"input_ids": [ids(t) for t in text] if isinstance(text, list) else ids(text)}


def test_encode_record_appends_eos_only_to_stopped_samples():
    record = grpo.Record("t", "12", (grpo.Sample("3", 1.0, "stop"), grpo.Sample("45", 0.0, "length")))
    a, b = grpo.encode_record(_CharTokenizer(), record)
    assert a.prompt_ids == b.prompt_ids == (1, 11, 12)
    assert a.completion_ids == (13, 2)
    assert b.completion_ids == (14, 15)
    assert a.advantage > 0 > b.advantage


def _merging_bpe():
    """A BPE tokenizer that merges "4" "2" into "42": sampled one digit at a time, the text
    "42" re-tokenizes into one token."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "4": 2, "2": 3, "42": 4, "+": 5, "=": 6, "1": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("4", "2")]))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def test_a_completion_whose_text_retokenizes_differently_is_trained_on_its_sampled_ids():
    tokenizer = _merging_bpe()
    sampled = [2, 3, 1]  # "4", "2", </s>: what the engine drew
    assert tokenizer("42", add_special_tokens=False)["input_ids"] == [4], "the text alone re-tokenizes into other ids"
    line = {"task_id": "t", "prompt": "41+1=", "prompt_token_ids": [0, 2, 7, 5, 7, 6], "answer": "42",
            "samples": [{"text": "42", "token_ids": sampled, "reward": 1.0, "finish_reason": "stop"},
                        {"text": "1", "token_ids": [7, 1], "reward": 0.0, "finish_reason": "stop"}]}
    record = grpo.parse_record(json.loads(json.dumps(line)))
    right, wrong = grpo.encode_record(tokenizer, record)
    assert right.prompt_ids == (0, 2, 7, 5, 7, 6) and right.completion_ids == tuple(sampled)
    batch = grpo.collate([right, wrong], pad_id=1)
    assert batch.input_ids[:, 1:][batch.target_mask].tolist() == sampled + [7, 1], "the trained targets are the sampled ids"
    without_ids = grpo.Record("t", "41+1=", (grpo.Sample("42", 1.0, "stop"),))
    assert grpo.encode_record(tokenizer, without_ids)[0].completion_ids == (4, 1), "what re-tokenizing would have trained on"


@pytest.mark.parametrize("change, complaint", [
    ({"prompt_token_ids": [0, -1]}, "'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": []}, "'prompt_token_ids' must not be empty"),
    ({"samples": [{"text": "4", "reward": 1, "finish_reason": "stop"}]}, "samples[0].token_ids is missing"),
    ({"samples": [{"text": "4", "token_ids": [2.0], "reward": 1, "finish_reason": "stop"}]}, "samples[0].token_ids must be a list"),
])
def test_a_record_with_bad_token_ids_is_refused(change, complaint):
    line = {"task_id": "t", "prompt": "4", "prompt_token_ids": [0, 2],
            "samples": [{"text": "4", "token_ids": [2, 1], "reward": 1, "finish_reason": "stop"}], **change}
    with pytest.raises(ValueError, match=re.escape(complaint)):
        grpo.parse_record(line)


def test_collate_right_pads_and_marks_the_targets_that_are_completion_tokens():
    batch = grpo.collate([_completion([1, 5], [6, 7], 0.5), _completion([1, 5, 5, 5], [8], -1.0)], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 0], [1, 5, 5, 5, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert batch.input_ids[:, 1:][batch.target_mask].tolist() == [6, 7, 8]
    assert batch.advantages.tolist() == [0.5, 0.5, -1.0]
    assert batch.num_tokens == 3


def test_collate_of_an_empty_completion_has_no_tokens():
    batch = grpo.collate([_completion([1, 5], [])], pad_id=0)
    assert batch.num_tokens == 0
    assert not batch.target_mask.any()


# --- log-probs -----------------------------------------------------------------------------


class _ToyLM(torch.nn.Module):
    """A causal LM in miniature: the logits at t depend on tokens <= t only."""

    def __init__(self, vocab=20):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=False, position_ids=None):
        hidden = self.embed(input_ids).cumsum(1)
        return type("Out", (), {"logits": self.head(hidden)})

    def get_output_embeddings(self):
        return self.head


def test_completion_logprobs_equal_a_manual_log_softmax_gather():
    model = _ToyLM()
    completions = [_completion([1, 5], [6, 7, 2]), _completion([1, 5, 9, 9], [3])]
    batch = grpo.collate(completions, pad_id=0)
    got = grpo.completion_logprobs(model, batch)

    expected = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        logits = model(ids, torch.ones_like(ids), False).logits[0]
        for pos in range(len(c.prompt_ids), ids.shape[1]):
            expected.append(torch.log_softmax(logits[pos - 1], -1)[ids[0, pos]].item())
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


def test_completion_logprobs_of_the_tiny_llama_ignore_right_padding(tmp_path):
    from orchestrator.demo import model as demo_model

    model = demo_model.create(0).eval()
    demo_model.save(model, tmp_path)
    _, tokenizer = demo_model.load(tmp_path)
    record = grpo.Record("t", "12+3=", (grpo.Sample("15", 1.0, "stop"), grpo.Sample("1", 0.0, "length")))
    long = grpo.Record("u", "40+40=", (grpo.Sample("80", 1.0, "stop"),))
    short, padded = grpo.encode_record(tokenizer, record), grpo.encode_record(tokenizer, long)
    with torch.no_grad():
        alone = grpo.completion_logprobs(model, grpo.collate(short, tokenizer.pad_token_id))
        together = grpo.completion_logprobs(model, grpo.collate(short + padded, tokenizer.pad_token_id))
    assert alone.numel() == 3 + 1
    assert together[: alone.numel()].tolist() == pytest.approx(alone.tolist(), abs=1e-5)


def test_a_sequences_logprobs_are_the_same_whatever_it_is_packed_with(tmp_path):
    """Packed rows (several sequences one after another, positions restarting at each): a
    sequence's log-probs and entropies are those it has alone, whatever precedes it in its
    row, whatever the other rows hold; the flat tensors follow the rows in order."""
    from orchestrator.demo import model as demo_model

    model = demo_model.create(0).eval()
    demo_model.save(model, tmp_path)
    _, tokenizer = demo_model.load(tmp_path)

    def encoded(prompt: str, *texts: str) -> list[grpo.Completion]:
        return grpo.encode_record(tokenizer, grpo.Record("t", prompt, tuple(grpo.Sample(t, 1.0, "stop") for t in texts)))

    a, b = encoded("12+3=", "15", "1")
    c, d, e = encoded("40+40=", "80", "8000", "7")
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        alone = {name: grpo.completion_logprobs(model, grpo.collate([x], pad), entropy=True) for name, x in zip("abcde", (a, b, c, d, e))}
        batch = grpo.collate_rows([[c, a], [d, b, e]], pad)
        packed, entropy = grpo.completion_logprobs(model, batch, entropy=True, head_at_targets=True)
    assert batch.attention_mask is None and batch.position_ids[1].tolist()[:9] == list(range(9))
    order = "cadbe"
    assert batch.lengths.tolist() == [alone[n][0].numel() for n in order]
    for values, which in ((packed, 0), (entropy, 1)):
        expected = torch.cat([alone[n][which] for n in order])
        assert values.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert grpo.collate_rows([[a], [d]], pad).position_ids is None, "one sequence a row: padded as collate pads"


# --- loss ----------------------------------------------------------------------------------


def test_loss_is_minus_the_mean_advantage_when_the_ratio_is_one():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0])
    parts = grpo.grpo_loss(lp, lp.detach().clone(), adv, clip_eps=0.2)
    assert parts.loss.item() == pytest.approx(-adv.mean().item())
    assert parts.clip_fraction == 0.0
    assert parts.kl is None


def test_clipping_stops_the_gain_beyond_one_plus_eps_for_positive_advantages():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.5])).requires_grad_()
    surrogate = grpo.clipped_surrogate(new, old, torch.tensor([1.0, 1.0]), clip_eps=0.2)
    assert surrogate.tolist() == pytest.approx([1.2, 0.5])  # min(1.5, 1.2), min(0.5, 0.8)
    surrogate.sum().backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.5])  # the clipped token gets no gradient


def test_clipping_stops_the_gain_below_one_minus_eps_for_negative_advantages():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([0.5, 1.5])).requires_grad_()
    surrogate = grpo.clipped_surrogate(new, old, torch.tensor([-1.0, -1.0]), clip_eps=0.2)
    assert surrogate.tolist() == pytest.approx([-0.8, -1.5])  # min(-0.5, -0.8), min(-1.5, -1.2)
    surrogate.sum().backward()
    assert new.grad.tolist() == pytest.approx([0.0, -1.5])


def test_clip_fraction_counts_tokens_outside_the_range():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.0, 1.1, 1.5, 0.5]))
    parts = grpo.grpo_loss(new, old, torch.ones(4), clip_eps=0.2)
    assert parts.clip_fraction == pytest.approx(0.5)


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    ref = torch.tensor([-1.0, -1.0, -1.0])
    new = torch.tensor([-1.0, -0.5, -3.0])
    k3 = grpo.k3_kl(new, ref)
    assert k3[0].item() == 0.0
    assert (k3[1:] > 0).all()
    d = ref - new
    assert k3.tolist() == pytest.approx((d.exp() - d - 1).tolist())


def test_kl_term_is_added_only_with_a_coefficient_and_reference():
    new = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    adv = torch.zeros(2)
    k3_mean = grpo.k3_kl(new, ref).mean().item()
    with_kl = grpo.grpo_loss(new, new, adv, clip_eps=0.2, kl_coef=0.1, ref_logprobs=ref)
    assert with_kl.loss.item() == pytest.approx(0.1 * k3_mean)
    assert with_kl.kl == pytest.approx(k3_mean)
    assert grpo.grpo_loss(new, new, adv, clip_eps=0.2, kl_coef=0.0, ref_logprobs=ref).loss.item() == 0.0
    assert grpo.grpo_loss(new, new, adv, clip_eps=0.2, kl_coef=0.1).loss.item() == 0.0


def test_a_batch_without_tokens_gives_a_zero_loss_that_still_backpropagates():
    weight = torch.ones(3, requires_grad=True)
    lp = (weight * 0)[:0]
    parts = grpo.grpo_loss(lp, lp.detach(), torch.zeros(0), clip_eps=0.2)
    assert parts.loss.item() == 0.0 and parts.tokens == 0
    parts.loss.backward()
    assert weight.grad.tolist() == [0.0, 0.0, 0.0]


# --- importance-sampling correction -----------------------------------------------------------


def test_tis_truncates_the_ratio_at_the_cap_and_mis_drops_the_tokens_past_it():
    behaviour = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.4]))
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.2]))  # ratios 1, 2, 5, 0.5
    weights, ratio = grpo.is_weights(old, behaviour, mode="tis", cap=2.0)
    assert ratio.tolist() == pytest.approx([1.0, 2.0, 5.0, 0.5])
    assert weights.tolist() == pytest.approx([1.0, 2.0, 2.0, 0.5])
    weights, _ = grpo.is_weights(old, behaviour, mode="mis", cap=2.0)
    assert weights.tolist() == pytest.approx([1.0, 2.0, 0.0, 0.5])  # 2 is not past the cap
    with pytest.raises(ValueError):
        grpo.is_weights(old, behaviour, mode="none", cap=2.0)


def test_the_weights_scale_each_tokens_surrogate_and_its_gradient_not_the_kl():
    # By hand: ratio new/old 1 everywhere, advantages 1 and -2, weights 0.5 and 2: the loss is
    # -(0.5 * 1 + 2 * -2) / 2 = 1.75, and d loss / d new_lp = -w * A / 2 = [-0.25, 2.0].
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    parts = grpo.grpo_loss(new, new.detach().clone(), torch.tensor([1.0, -2.0]), clip_eps=0.2, weights=torch.tensor([0.5, 2.0]))
    assert parts.loss.item() == pytest.approx(1.75)
    parts.loss.backward()
    assert new.grad.tolist() == pytest.approx([-0.25, 2.0])
    ref = torch.tensor([-1.5, -1.0])
    k3 = grpo.k3_kl(new.detach(), ref).mean().item()
    zero_adv = grpo.grpo_loss(new.detach(), new.detach(), torch.zeros(2), clip_eps=0.2, kl_coef=0.1, ref_logprobs=ref,
                              weights=torch.tensor([0.0, 0.0]))
    assert zero_adv.loss.item() == pytest.approx(0.1 * k3)  # the KL term is not weighted


def test_a_records_engine_logprobs_reach_its_completions_when_they_fit_its_token_ids():
    record = grpo.parse_record({"task_id": "t", "prompt": "1+1=", "prompt_token_ids": [1, 5],
                                "samples": [{"text": "2", "token_ids": [7, 2], "reward": 1.0, "finish_reason": "stop",
                                             "logprobs": [-0.1, -0.2]},
                                            {"text": "3", "token_ids": [8, 2], "reward": 0.0, "finish_reason": "stop",
                                             "logprobs": [-0.1]},  # one short: not used
                                            {"text": "4", "token_ids": [9, 2], "reward": 0.0, "finish_reason": "stop"}]})
    assert [s.logprobs for s in record.samples] == [(-0.1, -0.2), None, None]
    completions = grpo.encode_record(None, record)
    assert [c.behaviour_logprobs for c in completions] == [(-0.1, -0.2), None, None]


def test_an_agents_earlier_segments_are_sequences_of_their_own_with_their_samples_advantage():
    seg = {"prompt_token_ids": [1, 9, 9], "token_ids": [4, 4, 2], "logprobs": [-0.3, -0.3, -0.1], "loss_mask": [1, 0, 1]}
    record = grpo.parse_record({"task_id": "t", "prompt": "q", "prompt_token_ids": [1, 5],
                                "samples": [{"text": "a", "token_ids": [7, 2], "reward": 1.0, "finish_reason": "stop",
                                             "logprobs": [-0.1, -0.2], "segments": [seg]},
                                            {"text": "b", "token_ids": [8, 2], "reward": 0.0, "finish_reason": "stop"}]})
    assert record.samples[0].segments == (grpo.Segment((1, 9, 9), (4, 4, 2), (-0.3, -0.3, -0.1), (1, 0, 1)),)
    first, second, segment = grpo.encode_record(None, record)
    assert (first.prompt_ids, second.prompt_ids) == ((1, 5), (1, 5)) and first.advantage > 0 > second.advantage
    assert segment.prompt_ids == (1, 9, 9) and segment.completion_ids == (4, 4, 2) and segment.advantage == first.advantage
    assert segment.loss_mask == (1, 0, 1) and segment.behaviour_logprobs == (-0.3, -0.3, -0.1)
    with pytest.raises(ValueError, match=r"samples\[0\].segments\[0\].prompt_token_ids must not be empty"):
        grpo.parse_record({"task_id": "t", "prompt": "q", "prompt_token_ids": [1],
                           "samples": [{"text": "a", "token_ids": [2], "reward": 1.0, "finish_reason": "stop",
                                        "segments": [{**seg, "prompt_token_ids": []}]}]})


# --- the update's options -----------------------------------------------------------------------


def test_dr_grpo_and_rloo_advantages_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]  # mean 0.6
    assert grpo.group_advantages(rewards, "dr_grpo") == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    # rloo: r minus the mean of the other four: 1 - 2/4, 0 - 3/4, ...
    assert grpo.group_advantages(rewards, "rloo") == pytest.approx([0.5, -0.75, -0.75, 0.5, 0.5])
    for kind in grpo.ADVANTAGES:
        assert grpo.group_advantages([0.5, 0.5], kind) == [0.0, 0.0]
        assert grpo.group_advantages([1.0], kind) == [0.0]
    with pytest.raises(ValueError):
        grpo.group_advantages(rewards, "ppo")


def test_kl_estimators_by_hand():
    new = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])  # d = ref - new = 0, 1, -1
    assert grpo.kl_estimate(new, ref, "k1").tolist() == pytest.approx([0.0, -1.0, 1.0])
    assert grpo.kl_estimate(new, ref, "k2").tolist() == pytest.approx([0.0, 0.5, 0.5])
    assert grpo.kl_estimate(new, ref, "k3").tolist() == pytest.approx([0.0, math.e - 2, math.exp(-1)])
    parts = grpo.grpo_loss(new, new, torch.zeros(3), clip_eps=0.2, kl_coef=0.5, ref_logprobs=ref, kl_estimator="k2")
    assert parts.loss.item() == pytest.approx(0.5 * (0.0 + 0.5 + 0.5) / 3) and parts.kl == pytest.approx(1 / 3)


def test_clip_higher_lets_a_positive_advantage_gain_up_to_its_own_bound():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.25, 1.5, 0.7]))
    surrogate = grpo.clipped_surrogate(new, old, torch.tensor([1.0, 1.0, -1.0]), clip_eps=0.2, clip_eps_high=0.28)
    assert surrogate.tolist() == pytest.approx([1.25, 1.28, -0.8])  # min(1.25, 1.25), min(1.5, 1.28), min(-0.7, -0.8)
    parts = grpo.grpo_loss(new, old, torch.ones(3), clip_eps=0.2, clip_eps_high=0.28)
    assert parts.clip_fraction == pytest.approx(2 / 3)  # 1.5 above 1.28, 0.7 below 0.8


# --- loss aggregation, sequence ratio, overlong shaping, group filter ----------------------


def _two_sequences():
    """Two completions of 1 and 3 tokens with advantages 2 and -1; at ratio 1 their per-token
    losses are -A: [-2], [1, 1, 1]."""
    completions = [_completion([5], [7], 2.0), _completion([5], [7, 8, 9], -1.0)]
    return completions, grpo.collate(completions, pad_id=0)


@pytest.mark.parametrize("loss_agg, expected", [
    ("token_mean", (-2 + 1 + 1 + 1) / 4),  # every token alike
    ("seq_mean_token_sum", (-2 + 3) / 2),  # each sequence's sum, averaged over the 2
    ("seq_mean_token_mean", (-2 / 1 + 3 / 3) / 2),  # each sequence's mean, averaged
])
def test_loss_aggregations_by_hand(loss_agg, expected):
    completions, batch = _two_sequences()
    lp = torch.tensor([-1.0, -0.5, -0.7, -0.2])
    scale = grpo.token_scale(completions, loss_agg)
    parts = grpo.grpo_loss(lp, lp, batch.advantages, clip_eps=0.2, lengths=batch.lengths, loss_agg=loss_agg,
                           scale=None if scale is None else torch.tensor(scale))
    assert parts.loss.item() == pytest.approx(expected)
    # A step's share: the sum over this batch divided by the normaliser the plan gives.
    shared = grpo.grpo_loss(lp, lp, batch.advantages, clip_eps=0.2, lengths=batch.lengths, normalizer=8.0,
                            scale=None if scale is None else torch.tensor(scale))
    assert shared.loss.item() == pytest.approx(expected * (4 if loss_agg == "token_mean" else 2) / 8)


def test_token_scales_by_hand_and_an_untrained_sample_weighs_nothing():
    completions, _ = _two_sequences()
    assert grpo.token_scale(completions, "token_mean") is None
    assert grpo.token_scale(completions, "seq_mean_token_sum") is None
    assert grpo.token_scale(completions, "seq_mean_token_mean") == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    cut = [completions[0], grpo.Completion((5,), (7, 8, 9), -1.0, trained=False)]
    assert grpo.token_scale(cut, "token_mean") == [1.0, 0.0, 0.0, 0.0]
    assert grpo.token_scale(cut, "seq_mean_token_mean") == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="loss_agg"):
        grpo.token_scale(completions, "sum")


def test_the_sequence_ratio_is_each_sequences_geometric_mean_and_clips_whole_sequences():
    _, batch = _two_sequences()
    old = torch.zeros(4)
    new = torch.tensor([0.1, 0.3, -0.3, 0.6], requires_grad=True)  # sequence means 0.1 and 0.2
    log_r = grpo.log_ratio(new, old, level="sequence", lengths=batch.lengths)
    assert log_r.tolist() == pytest.approx([0.1, 0.2, 0.2, 0.2])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0])
    parts = grpo.grpo_loss(new, old, adv, clip_eps=0.1, ratio_level="sequence", lengths=batch.lengths, loss_agg="seq_mean_token_mean",
                           scale=torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3]))
    # sequence 1: ratio e^0.1 = 1.105 > 1.1, clipped: -1.1; sequence 2: e^0.2 clipped too: -1.1
    assert parts.loss.item() == pytest.approx(-1.1) and parts.clip_fraction == 1.0
    parts.loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0] * 4)  # clipped with a positive advantage: no gradient
    new.grad = None
    parts = grpo.grpo_loss(new, old, adv, clip_eps=0.3, ratio_level="sequence", lengths=batch.lengths, loss_agg="seq_mean_token_mean",
                           scale=torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3]))
    s1, s2 = math.exp(0.1), math.exp(0.2)
    assert parts.loss.item() == pytest.approx(-(s1 + s2) / 2)
    parts.loss.backward()
    # GSPO's gradient: each token's log-prob gradient weighed by its sequence's ratio, over its length
    assert new.grad.tolist() == pytest.approx([-s1 / 2, -s2 / 6, -s2 / 6, -s2 / 6])
    # The token level keeps each token's own ratio.
    assert grpo.log_ratio(new, old).tolist() == pytest.approx([0.1, 0.3, -0.3, 0.6])


def test_overlong_penalty_by_hand():
    ramp = [grpo.overlong_penalty(n, max_tokens=8, buffer=4) for n in (3, 4, 5, 6, 8, 9)]
    assert ramp == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def _cut_record():
    """A group of 3: a right answer of 2 tokens, a right one cut at 4 tokens, a wrong one of 3."""
    return grpo.parse_record({"task_id": "t", "prompt": "p", "prompt_token_ids": [1], "samples": [
        {"text": "a", "token_ids": [4, 2], "reward": 1.0, "finish_reason": "stop"},
        {"text": "b", "token_ids": [5, 5, 5, 5], "reward": 1.0, "finish_reason": "length"},
        {"text": "c", "token_ids": [6, 6, 2], "reward": 0.0, "finish_reason": "stop"}]})


def test_overlong_shaping_penalises_by_length_before_the_advantages_or_masks_the_cut():
    record = _cut_record()
    penalty = grpo.encode_record(None, record, "dr_grpo", grpo.Shaping("penalty", max_tokens=4, buffer=2))
    shaped = [1.0 + 0.0, 1.0 - 1.0, 0.0 - 0.5]  # lengths 2, 4, 3 with the ramp over tokens 3-4
    mean = sum(shaped) / 3
    assert [c.advantage for c in penalty] == pytest.approx([r - mean for r in shaped])
    assert all(c.trained for c in penalty)
    masked = grpo.encode_record(None, record, "dr_grpo", grpo.Shaping("mask", max_tokens=4, buffer=2))
    assert [c.trained for c in masked] == [True, False, True]
    assert [c.advantage for c in masked] == pytest.approx([1 / 3, 1 / 3, -2 / 3])  # the cut one still counts in the group
    kept = grpo.encode_record(None, record, "dr_grpo")
    assert [c.advantage for c in kept] == [c.advantage for c in masked] and all(c.trained for c in kept)


def test_a_group_is_informative_when_its_rewards_vary():
    assert grpo.informative(_cut_record())
    flat = grpo.parse_record({"task_id": "t", "prompt": "p", "samples": [
        {"text": "a", "reward": 1.0, "finish_reason": "stop"}, {"text": "b", "reward": 1.0, "finish_reason": "stop"}]})
    assert not grpo.informative(flat)


# --- multi-turn samples: observation tokens in the context, out of the loss ------------------


def test_a_multi_turn_sample_trains_on_exactly_its_sampled_ids_and_masks_the_observation():
    """Turn 1 sampled "4" "2" (ids 2, 3: "42" would re-tokenize as the merged id 4), the
    environment answered "+" (id 5, context only), turn 2 sampled "1" and EOS (7, 1)."""
    tokenizer = _merging_bpe()
    ids, mask = [2, 3, 5, 7, 1], [1, 1, 0, 1, 1]
    assert tokenizer("42+1", add_special_tokens=False)["input_ids"] != ids[:4], "the text re-tokenizes into other ids"
    line = {"task_id": "t", "prompt": "41+1=", "prompt_token_ids": [0, 2, 7, 5, 7, 6], "answer": "42",
            "samples": [{"text": "42+1", "token_ids": ids, "loss_mask": mask, "logprobs": [-0.5, -0.2, 0.0, -0.1, -0.3],
                         "reward": 1.0, "finish_reason": "stop"},
                        {"text": "1", "token_ids": [7, 1], "reward": 0.0, "finish_reason": "stop"}]}
    record = grpo.parse_record(json.loads(json.dumps(line)))
    multi, single = grpo.encode_record(tokenizer, record)
    assert multi.completion_ids == tuple(ids) and multi.loss_mask == tuple(mask) and multi.trained_tokens() == 4
    batch = grpo.collate([multi, single], pad_id=1)
    assert batch.input_ids[:, 1:][batch.target_mask].tolist() == ids + [7, 1], "the targets are the sampled ids and the observation's"
    assert batch.mask.tolist() == [1, 1, 0, 1, 1, 1, 1] and batch.scale.tolist() == batch.mask.tolist()
    # The loss and its gradient come from the sampled tokens only: at ratio 1 each token's loss
    # is -A, and the observation's token has no gradient.
    lp = torch.tensor([-0.5, -0.2, -3.0, -0.1, -0.3, -0.4, -0.6], requires_grad=True)
    parts = grpo.grpo_loss(lp, lp.detach(), batch.advantages, clip_eps=0.2, scale=batch.scale, mask=batch.mask, lengths=batch.lengths)
    a, b = batch.advantages[0].item(), batch.advantages[-1].item()
    assert parts.loss.item() == pytest.approx(-(4 * a + 2 * b) / 6)  # 6 tokens in the loss, not 7
    parts.loss.backward()
    assert lp.grad[2].item() == 0.0 and all(g != 0 for i, g in enumerate(lp.grad.tolist()) if i != 2)
    # The sequence ratio is the mean over the sampled tokens only.
    new = torch.tensor([0.3, 0.3, 9.0, 0.3, 0.3, 0.0, 0.0])
    assert grpo.log_ratio(new, torch.zeros(7), level="sequence", lengths=batch.lengths, mask=batch.mask)[:5].tolist() == pytest.approx([0.3] * 5)
    # Per sequence, seq_mean_token_mean divides by the tokens in the loss.
    assert grpo.token_scale([multi, single], "seq_mean_token_mean") == pytest.approx([0.25, 0.25, 0.0, 0.25, 0.25, 0.5, 0.5])


@pytest.mark.parametrize("mask, complaint", [
    ([1, 0], "loss_mask must be a list of 0 and 1, one per token id (3)"),
    ([1, 2, 1], "loss_mask must be a list of 0 and 1"),
    ([True, False, True], "loss_mask must be a list of 0 and 1"),
])
def test_a_bad_loss_mask_is_refused(mask, complaint):
    line = {"task_id": "t", "prompt": "4", "prompt_token_ids": [0, 2],
            "samples": [{"text": "4", "token_ids": [2, 5, 1], "loss_mask": mask, "reward": 1, "finish_reason": "stop"}]}
    with pytest.raises(ValueError, match=re.escape(complaint)):
        grpo.parse_record(line)
