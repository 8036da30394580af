"""A short supervised warm start of the demo model, so that RL starts from a policy that is
clearly better than chance and clearly short of perfect. Deterministic for a seed."""

from __future__ import annotations

import logging
import random

log = logging.getLogger(__name__)


def _batch(tokenizer, tasks: list[dict]):
    """Token ids of ``prompt answer </s>``, with labels only on the answer and ``</s>``."""
    import torch

    rows, labels = [], []
    for t in tasks:
        prompt = tokenizer(t["prompt"])["input_ids"]
        answer = tokenizer(t["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, lab, mask


def warm_start(model, tokenizer, tasks: list[dict], *, steps: int, seed: int, batch_size: int = 64, lr: float = 3e-3) -> list[float]:
    """Train ``model`` in place for ``steps`` steps; returns the loss per step."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        ids, labels, mask = _batch(tokenizer, rng.sample(tasks, min(batch_size, len(tasks))))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def greedy_accuracy(model, tokenizer, tasks: list[dict], max_new_tokens: int = 4) -> float:
    """Share of tasks whose greedy completion (up to ``</s>``) equals the answer."""
    import torch

    correct = 0
    with torch.inference_mode():
        for start in range(0, len(tasks), 256):
            chunk = tasks[start : start + 256]
            enc = [tokenizer(t["prompt"])["input_ids"] for t in chunk]
            width = max(map(len, enc))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            out = []
            for _ in range(max_new_tokens):
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
                out.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
            gen = torch.stack(out, 1).tolist()
            for t, g in zip(chunk, gen):
                if tokenizer.eos_token_id in g:
                    g = g[: g.index(tokenizer.eos_token_id)]
                correct += tokenizer.decode(g, skip_special_tokens=True) == t["answer"]
    return correct / len(tasks)
