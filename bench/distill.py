"""On-policy distillation on the chat demo: the chat demo's policy trained by RL (the README's
ten iterations) is exported and taught to its own warm-started base with ``rl.distill_only``
(no reward: each token's advantage is the reverse KL to the teacher), and the student's eval
accuracy is compared with the teacher's and the base's.

    python bench/distill.py                         # seed 0, ~6 min on 2 cores
    python bench/distill.py --seed 1 --kernels default

Steps, each a real run of ``orchestrator`` on fresh paths under a temporary directory:

1. ``demo-data --chat`` (``--seed``), then the README's chat demo run (``--teacher-iterations``
   iterations) and ``export`` of its final policy: the teacher.
2. The teacher's eval accuracy: an eval-only run on it (``model.path``), the demo's eval set.
3. The student: the same data and base, ``models.teacher.path`` the teacher, ``rl.teacher``,
   ``rl.distill_coef`` ``--coef``, ``rl.distill_only``, ``--iterations`` updates; evaluated
   before the first (the base) and after the last.

Recovered: the student's gain over the base as a share of the teacher's. Writes JSON (default
bench/results/distill-seed<seed>.json).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", default=None, help="ATEN_CPU_CAPABILITY for every process (default: the CPU's own)")
    ap.add_argument("--teacher-iterations", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=5, help="the student's updates")
    ap.add_argument("--coef", type=float, default=1.0, help="rl.distill_coef")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    env = kernels_env(args.kernels)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        tmp = Path(tmp)
        data, teacher = tmp / "chat", tmp / "teacher"
        print(f"seed {args.seed}, kernels {args.kernels or 'native'}: the teacher ({args.teacher_iterations} iterations of RL)", flush=True)
        orchestrator("demo-data", "--chat", f"--data-path={data}", f"--seed={args.seed}", env=env)
        rl = tmp / "rl-run"
        orchestrator("run", f"--data-path={data}", f"--log-path={rl}", "--rl-phase=both", "--eval-interval=3",
                     f"--max-iterations={args.teacher_iterations}", f"seed={args.seed}", env=env)
        orchestrator("export", f"--log-path={rl}", f"--out={teacher}", env=env)
        rl_curve = accuracies(rl, env)
        orchestrator("run", f"--data-path={data}", f"--log-path={tmp / 'teacher-eval'}", "--rl-phase=rollout",
                     "--rollout-split=eval-only", "--max-iterations=1", f"model.path={teacher}", f"seed={args.seed}", env=env)
        teacher_accuracy = accuracies(tmp / "teacher-eval", env)[1]
        print(f"the student ({args.iterations} updates, rl.distill_only)", flush=True)
        student = tmp / "distill-run"
        orchestrator("run", f"--data-path={data}", f"--log-path={student}", "--rl-phase=both", f"--eval-interval={args.iterations}",
                     f"--max-iterations={args.iterations + 1}", f"models.teacher.path={teacher}", "rl.teacher=teacher",
                     f"rl.distill_coef={args.coef:g}", "rl.distill_only=true", f"seed={args.seed}", env=env)
        curve = accuracies(student, env)
        summaries = [json.loads(p.read_text())["body"] for p in sorted(student.glob("iterations/*/summary.json"))]
        kl = [round(s["update"]["distill_reverse_kl"], 4) for s in summaries if "distill_reverse_kl" in s.get("update", {})]
    base, taught = curve[1], curve[args.iterations + 1]
    recovered = (taught - base) / (teacher_accuracy - base) if teacher_accuracy > base else float("nan")
    result = {"seed": args.seed, "kernels": args.kernels or "native", "teacher_iterations": args.teacher_iterations,
              "rl_curve": rl_curve, "base": base, "teacher": teacher_accuracy, "student_updates": args.iterations,
              "student": taught, "recovered": recovered, "distill_coef": args.coef, "reverse_kl": kl,
              "seconds": round(time.monotonic() - began)}
    print(json.dumps(result, indent=2))
    out = args.out or REPO / "bench" / "results" / f"distill-seed{args.seed}{'-' + args.kernels if args.kernels else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
