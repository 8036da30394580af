"""Aggregating 16 rollout shards: ours (JSON lines, sealed, merged by streaming) against the
reference's approach (per-rank dicts of lists with torch.save; torch.load each,
concatenate, torch.save).

    python bench/aggregation.py                                   # 10^5 and 10^6 trajectories
    python bench/aggregation.py --trajectories 100000 --repeats 3 --work-dir /tmp

Data: 16 shards, one per rank, holding --trajectories trajectories in all, generated once per
size with a fixed seed. A record is what the RL loop writes (orchestrator/workloads/rl/workload.py,
``_record``): one task with ``--samples`` samples (``rl.samples_per_prompt``, default 16),
each sample a text, a reward, a finish reason and the logprobs of its --tokens tokens
(``rl.max_tokens``, default 8); a trajectory is one sample. The reference keeps the same
fields per trajectory, as a dict of lists (``task_id``, ``prompt``, ``answer``, ``text``,
``reward``, ``finish_reason``, ``logprobs``), one per rank. With --rows, a variant of the
reference keeps one dict per trajectory instead (``{"trajectories": [{...}, ...]}``), as a
rollout loop that appends each sample's dict would.

Each step runs in a fresh Python process that reports its own wall time and peak resident
memory (``getrusage(RUSAGE_SELF).ru_maxrss``), and its resident memory just before the step
(after its imports: torch for the reference):

ours: seal       ``orchestrator.data.shards.seal`` of the 16 shards (each rank seals its own shard
                 in the run, in parallel; here one after the other)
ours: merge      ``orchestrator.data.shards.merge`` of the 16 sealed shards into one aggregate:
                 streams, re-hashes each shard against its manifest, parses each line and
                 rejects duplicate task ids, writes a temp file, fsyncs, renames, writes the
                 manifest (what the master does in phase 4)
ref: save        ``torch.save`` of each rank's dict of lists (time only: building the dict
                 from the shard, not timed, dominates the memory)
ref: aggregate   ``torch.load(weights_only=False)`` of the 16 files, concatenation of every
                 list, ``torch.save`` of the result (what the master would do)

All files are written just before they are read, so reads come from the page cache on both
sides. Throughput = trajectories / wall seconds of the step. With --repeats R each step runs
R times and the table shows the median run (by wall time). Writes JSON (default
bench/results/aggregation.json).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, err_console, loadavg, machine, python_env, table, wait_for_quiet, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "aggregation.json"
SHARDS = 16
KEYS = ("task_id", "prompt", "answer", "text", "reward", "finish_reason", "logprobs")


# -- steps (each in its own process) ----------------------------------------------------------------

def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _shard(d: Path, r: int) -> Path:
    return d / f"r{r:05d}.jsonl"


def step_generate(d: Path, trajectories: int, samples: int, tokens: int, seed: int) -> dict:
    records = -(-trajectories // samples)  # tasks, rounded up
    per_rank = [records // SHARDS + (1 if r < records % SHARDS else 0) for r in range(SHARDS)]
    rng = random.Random(seed)
    task = 0
    for r, count in enumerate(per_rank):
        with open(_shard(d, r), "w") as f:
            for _ in range(count):
                a, b = rng.randrange(100), rng.randrange(100)
                group = []
                for _s in range(samples):
                    n = rng.randint(1, tokens)
                    text = str(a + b + rng.choice((0, 0, 0, 1, -1, 10)))[: n]
                    group.append({"text": text, "reward": float(text == str(a + b)),
                                  "finish_reason": "stop" if n < tokens else "length",
                                  "logprobs": [-rng.random() * 3 for _ in range(n)]})
                record = {"task_id": f"train-000001-{task:07d}", "split": "train", "iteration": 1, "rank": r,
                          "attempt": "a000001-bench0", "policy": "/data/model", "prompt": f"{a}+{b}=",
                          "answer": str(a + b), "seconds": rng.random() / 100, "samples": group}
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
                task += 1
    return {"records": records, "trajectories": records * samples,
            "bytes": sum(_shard(d, r).stat().st_size for r in range(SHARDS))}


def step_seal(d: Path) -> dict:
    from orchestrator.data import shards

    for r in range(SHARDS):
        shards.manifest_path(_shard(d, r)).unlink(missing_ok=True)
    began = time.perf_counter()
    for r in range(SHARDS):
        shards.seal(_shard(d, r), rank=r, split="train", iteration=1)
    return {"seconds": time.perf_counter() - began}


def step_merge(d: Path) -> dict:
    from orchestrator.data import shards

    dest = d / "aggregate" / "train.jsonl"
    began = time.perf_counter()
    m = shards.merge([(f"rank {r}", _shard(d, r)) for r in range(SHARDS)], dest, split="train", iteration=1)
    return {"seconds": time.perf_counter() - began, "trajectories": m.extra["trajectories"], "bytes_out": m.bytes}


def _columns(shard: Path) -> dict:
    cols = {k: [] for k in KEYS}
    with open(shard, "rb") as f:
        for line in f:
            rec = json.loads(line)
            for s in rec["samples"]:
                cols["task_id"].append(rec["task_id"])
                cols["prompt"].append(rec["prompt"])
                cols["answer"].append(rec["answer"])
                cols["text"].append(s["text"])
                cols["reward"].append(s["reward"])
                cols["finish_reason"].append(s["finish_reason"])
                cols["logprobs"].append(s["logprobs"])
    return cols


def _rows(shard: Path) -> dict:
    """The variant: one dict per trajectory, in a dict with one list (``trajectories``)."""
    cols = _columns(shard)
    return {"trajectories": [dict(zip(KEYS, values)) for values in zip(*(cols[k] for k in KEYS))]}


def _ref_save(d: Path, layout) -> dict:
    import torch

    seconds = 0.0
    for r in range(SHARDS):
        per_rank = layout(_shard(d, r))
        began = time.perf_counter()
        torch.save(per_rank, d / f"r{r:05d}.{layout.__name__}.pt")
        seconds += time.perf_counter() - began
        del per_rank
    return {"seconds": seconds}


def _ref_aggregate(d: Path, layout) -> dict:
    import torch

    out = d / f"merged.{layout.__name__}.pt"
    began = time.perf_counter()
    merged: dict[str, list] | None = None
    for r in range(SHARDS):
        part = torch.load(d / f"r{r:05d}.{layout.__name__}.pt", weights_only=False)
        if merged is None:
            merged = part
        else:
            for k, values in part.items():
                merged[k].extend(values)
        del part
    torch.save(merged, out)
    n = len(next(iter(merged.values())))
    return {"seconds": time.perf_counter() - began, "trajectories": n, "bytes_out": out.stat().st_size}


STEPS = {
    "seal": step_seal,
    "merge": step_merge,
    "ref-save": lambda d: _ref_save(d, _columns),
    "ref-aggregate": lambda d: _ref_aggregate(d, _columns),
    "ref-rows-save": lambda d: _ref_save(d, _rows),
    "ref-rows-aggregate": lambda d: _ref_aggregate(d, _rows),
}


def child_main(step: str, d: Path) -> None:
    if step.startswith("ref-"):
        import torch  # noqa: F401 - its import is part of the resident memory before the step
    else:
        import orchestrator.data.shards  # noqa: F401
    before = _rss_mib()
    result = STEPS[step](d)
    result["rss_before_mib"] = before
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


# -- driver --------------------------------------------------------------------------------------

def run_step(step: str, d: Path, timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", step, "--dir", str(d)], capture_output=True, text=True,
                          env=python_env(), timeout=timeout_s)
    if proc.returncode != 0:
        raise BenchError(f"step {step} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_size(trajectories: int, a: argparse.Namespace, work: Path) -> dict:
    d = work / f"t{trajectories}"
    d.mkdir()
    console.print(f"{trajectories} trajectories: generating 16 shards ...", markup=False)
    data = step_generate(d, trajectories, a.samples, a.tokens, a.seed)
    out = {"trajectories": data["trajectories"], "records": data["records"], "shard_bytes": data["bytes"], "steps": {}}
    steps = ["seal", "merge", "ref-save", "ref-aggregate"] + (["ref-rows-save", "ref-rows-aggregate"] if a.rows else [])
    for step in steps:
        runs = []
        for _ in range(a.repeats):
            console.print(f"  {step} ...", markup=False)
            runs.append(run_step(step, d, a.timeout_s))
        runs.sort(key=lambda x: x["seconds"])
        median = runs[(len(runs) - 1) // 2]
        out["steps"][step] = {**median, "trajectories_per_s": data["trajectories"] / median["seconds"],
                              "all_seconds": [x["seconds"] for x in runs]}
    out["pt_bytes"] = sum((d / f"r{r:05d}._columns.pt").stat().st_size for r in range(SHARDS))
    ours, ref = out["steps"]["merge"], out["steps"]["ref-aggregate"]
    out["merge_speedup"] = ref["seconds"] / ours["seconds"]
    out["merge_peak_ratio"] = ours["peak_rss_mib"] / ref["peak_rss_mib"]
    out["merge_growth_ratio"] = (ours["peak_rss_mib"] - ours["rss_before_mib"]) / (ref["peak_rss_mib"] - ref["rss_before_mib"])
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)
    return out


def render(result: dict) -> None:
    rows = []
    for size in result["sizes"]:
        for step, s in size["steps"].items():
            rows.append([f"{size['trajectories']:,}", step, f"{s['seconds']:.2f}", f"{s['trajectories_per_s']:,.0f}",
                         f"{s['rss_before_mib']:.0f}", f"{s['peak_rss_mib']:.0f}", f"{s['peak_rss_mib'] - s['rss_before_mib']:.0f}"])
    table("aggregating 16 shards (one fresh process per step)",
          ["trajectories", "step", "wall (s)", "trajectories/s", "RSS before (MiB)", "peak RSS (MiB)", "peak - before"], rows, 2)
    for size in result["sizes"]:
        console.print(f"{size['trajectories']:,} trajectories ({size['shard_bytes'] / 2**20:.0f} MiB of JSON lines, "
                      f"{size['pt_bytes'] / 2**20:.0f} MiB of torch.save files): ours merge is "
                      f"{size['merge_speedup']:.1f}x the reference's throughput at {size['merge_peak_ratio']:.2f} of its peak RSS "
                      f"({size['merge_growth_ratio']:.3f} of its growth during the step)", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, action="append", help="total over the 16 shards (repeat; default 10^5 and 10^6)")
    p.add_argument("--samples", type=int, default=16, help="samples per task (rl.samples_per_prompt; default 16)")
    p.add_argument("--tokens", type=int, default=8, help="most tokens per sample (rl.max_tokens; default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--rows", action="store_true",
                   help="also time a reference variant that keeps one dict per trajectory (ref-rows-*)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per step")
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    p.add_argument("--work-dir", type=Path, default=None, help="parent of the temp dir (default: the system's)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", choices=sorted(STEPS), help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_main(a.child, a.dir)
        return 0
    load = wait_for_quiet(a.max_load, a.max_wait_s)
    result = {"machine": machine(), "loadavg_at_start": load, "shards": SHARDS, "samples": a.samples, "tokens": a.tokens,
              "repeats": a.repeats, "sizes": []}
    work = Path(tempfile.mkdtemp(prefix="aggregation-", dir=a.work_dir))
    try:
        for t in a.trajectories or [100_000, 1_000_000]:
            result["sizes"].append(measure_size(t, a, work))
            write_json(a.out, result)
    except (BenchError, subprocess.TimeoutExpired) as e:
        err_console.print(f"aggregation: error: {e}", markup=False)
        return 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"]["loadavg_at_end"] = loadavg()
    render(result)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
