"""An LLM judge as the reward on the chat demo: the policy is trained with
``rl.reward=orchestrator.rewards:judge`` (the demo's judge model, ``demo-data --chat --judge``,
asked the built-in reference-guided verdict) and measured by eval with the math reward
(``rl.eval_reward``), before its first update and after its last. The judge's verdicts on the
train samples are compared with the math reward's.

    python bench/judge.py                         # seed 0, ~4 min on 2 cores
    python bench/judge.py --seed 1 --kernels default

Each step a real run of ``orchestrator`` on fresh paths under a temporary directory. Writes JSON
(default bench/results/judge-seed<seed>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout that is not installed
    sys.path.insert(0, str(REPO))

from bench.common import accuracies, kernels_env, orchestrator  # noqa: E402


def agreement(log: Path) -> dict:
    """The judge's verdicts on the run's train samples against the math reward's, and the
    train reward by iteration."""
    from orchestrator import rewards

    same = total = errors = 0
    train_reward = {}
    for path in sorted(log.glob("iterations/*/aggregate/train.jsonl")):
        rs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples = [(r, s) for r in rs for s in r["samples"]]
        train_reward[int(path.parts[-3])] = round(sum(s["reward"] for _, s in samples) / max(1, len(samples)), 4)
        for r, s in samples:
            errors += "reward_error" in s
            same += s["reward"] == rewards.math({"answer": r["answer"]}, s["text"])
            total += 1
    return {"samples": total, "agree_with_math": round(same / max(1, total), 4), "reward_errors": errors, "train_reward": train_reward}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", default=None, help="ATEN_CPU_CAPABILITY for every process (default: the CPU's own)")
    ap.add_argument("--iterations", type=int, default=5, help="updates on the judge's rewards")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    env = kernels_env(args.kernels)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        tmp = Path(tmp)
        data, run = tmp / "chat", tmp / "judged-run"
        print(f"seed {args.seed}, kernels {args.kernels or 'native'}: {args.iterations} updates on the judge's verdicts", flush=True)
        orchestrator("demo-data", "--chat", "--judge", f"--data-path={data}", f"--seed={args.seed}", env=env)
        orchestrator("run", f"--data-path={data}", f"--log-path={run}", "--rl-phase=both", f"--eval-interval={args.iterations}",
                     f"--max-iterations={args.iterations + 1}", "models.judge.path=judge", "judge.model=judge",
                     "rl.reward=orchestrator.rewards:judge", "rl.eval_reward=orchestrator.rewards:math", f"seed={args.seed}", env=env)
        curve = accuracies(run, env)
        judged = agreement(run)
        judge = json.loads((data / "demo.json").read_text()).get("judge", {})
    result = {"seed": args.seed, "kernels": args.kernels or "native", "updates": args.iterations, "eval_accuracy": curve,
              "before": curve[1], "after": curve[args.iterations + 1], "gain": round(curve[args.iterations + 1] - curve[1], 4),
              "judge": judged, "judge_model": judge, "seconds": round(time.monotonic() - began)}
    print(json.dumps(result, indent=2))
    out = args.out or REPO / "bench" / "results" / f"judge-seed{args.seed}{'-' + args.kernels if args.kernels else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
