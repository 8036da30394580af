"""The report's one static HTML page (``index.html``, no JavaScript), written from the data
``report.collect`` returned: the charts by relative file name, the per-iteration table and the
tables of where each iteration's time went. It links ``report.json``, which holds the same
numbers, so the page never shows a figure the JSON lacks.
"""

from __future__ import annotations

import html
import time

from orchestrator.ops.charts import WAIT_SCALE_MIN_S
from orchestrator.ops.timing import part_sort_key

REPORT_JSON = "report.json"
INDEX_HTML = "index.html"


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, list):
        return ":".join(str(x) for x in v)
    return str(v)


# The time tables put iterations across (phases and parts down, their labels once), so that
# the 14 phases never run off the page; the last this many iterations: report.json has all.
TIME_TABLE_ITERATIONS = 12


def _bytes(n) -> str:
    """1618098 as 1.6 MB (decimal units, as ``status`` shows them)."""
    if not isinstance(n, (int, float)):
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def time_tables(rows: list[dict]) -> str:
    """Tables of seconds per iteration, iterations across: the master's phases, and the train
    and engine parts (only when the run recorded any); then the policy's bytes."""
    e = html.escape
    timed = [r for r in rows if r.get("timing")]
    shown = timed[-TIME_TABLE_ITERATIONS:]
    out = []
    phases = sorted({lbl for r in timed for lbl in r["timing"]["phases"]}, key=lambda lbl: int(lbl.split(":")[0]))
    parts = sorted({p for r in timed for p in r["timing"]["parts"]}, key=part_sort_key)
    left_out = f" (the last {len(shown)} of {len(timed)} iterations; {REPORT_JSON} has every one)" if len(shown) < len(timed) else ""
    head = "<th>iteration</th>" + "".join(f"<th>{r['iteration']}</th>" for r in shown)
    for keys, of_phases, caption in ((phases, True, "seconds per phase (master)"), (parts, False, "slowest rank, worker or engine (s)")):
        if not keys:
            continue
        body = []
        if of_phases:
            body.append("<tr><th>total</th>" + "".join(f"<td>{e(_cell(r['timing']['total_s']))}</td>" for r in shown) + "</tr>")
        for k in keys:
            cells = [r["timing"]["phases" if of_phases else "parts"].get(k) for r in shown]
            body.append(f"<tr><th>{e(k)}</th>" + "".join(f"<td>{e(_cell(v))}</td>" for v in cells) + "</tr>")
        out.append(f'<table class="time">\n<caption>{e(caption + left_out)}</caption>\n<tr>{head}</tr>\n' + "\n".join(body) + "\n</table>")
    moved = [(r["iteration"], r["timing"]["bytes"]) for r in shown if r["timing"].get("bytes")]
    if moved:
        body = "\n".join(f"<tr><td>{i}</td><td>{_bytes(b['written'])}</td><td>{_bytes(b['read'])}</td></tr>" for i, b in moved)
        out.append('<table class="time">\n<caption>bytes of the policy per iteration: the checkpoint written, what the engines '
                   'read to serve it</caption>\n<tr><th>iteration</th><th>written</th><th>read</th></tr>\n' + body + "\n</table>")
    return "\n".join(out)


def index_html(data: dict) -> str:
    """One static page (no JavaScript): the charts, referenced by relative file name, a
    table of the per-iteration figures and tables of where each iteration's time went."""
    e = html.escape
    columns = [("iteration", "iteration"), ("tasks_per_rank", "tasks/rank"), ("tasks_done_per_rank", "done/rank"),
               ("tasks_taken_per_rank", "taken from"), ("trajectories", "trajectories"),
               ("train_mean_reward", "train mean reward"), ("eval_accuracy", "eval accuracy"),
               ("eval_pass_at_k", "eval pass@k"), ("eval_mean_reward", "eval mean reward"),
               ("master_s", "rank 0 time (s)"), ("complete", "complete")]
    if any(row.get("staleness") and max(row["staleness"]) for row in data["iterations"]):  # rl.max_staleness >= 1
        columns[-1:-1] = [("staleness", "staleness"), ("is_ratio_mean", "IS ratio mean"), ("is_ratio_max", "IS ratio max"),
                          ("is_capped_fraction", "IS capped")]
    head = "".join(f"<th>{e(name)}</th>" for _, name in columns)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{e(_cell(row.get(key)))}</td>" for key, _ in columns) + "</tr>" for row in data["iterations"]
    )
    attempts = ", ".join(e(a["attempt"]) for a in data["timeline"]["attempts"]) or "none"
    tables = time_tables(data["iterations"])
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["generated_at"]))
    charts = data["charts"]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>orchestrator report: {e(data['log_path'])}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }}
th {{ background: #eee; }}
table.time th:first-child {{ text-align: left; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0 1.5em; }}
.note {{ color: #666; font-size: 0.9em; }}
caption {{ text-align: left; color: #666; font-size: 0.9em; }}
</style>
</head>
<body>
<h1>Run report</h1>
<p>log path <code>{e(data['log_path'])}</code> &middot; generated {e(generated)} &middot; attempts: {attempts}</p>
<h2>Per iteration</h2>
<table>
<tr>{head}</tr>
{body}
</table>
<p class="note">The numbers are also in <a href="{REPORT_JSON}">{REPORT_JSON}</a>.</p>
<h2>Reward and evaluation</h2>
<p class="note">Left: the eval metrics per evaluated iteration; with a 0/1 reward the mean reward (wide dashed, hollow
diamonds) equals the accuracy (solid, filled circles) and runs under it. Right: the mean reward of the train samples.</p>
<img src="{e(charts['curves'])}" alt="eval metrics and train mean reward per iteration">
<h2>Where each iteration's time went</h2>
<p class="note">Left: the master's seconds in each phase, work and barrier wait together. Right: inside the train phase
and the engine phases (rollout, eval, engine stop, engine restart), the slowest rank, train worker or engine in each part;
<code>train.total</code> is a rank's whole wait for its trainers.</p>
<img src="{e(charts['breakdown'])}" alt="time per phase and inside train and engine phases, per iteration">
{tables}
<h2>Per-rank phase timeline</h2>
<p class="note">Full bars: a phase's work; thin pale bars: waiting at the phase's barrier; hatched: the master's decision.
A dotted line marks where each iteration starts (labelled it N on the top axis), a dashed one where each attempt starts.
Rows are placed by each rank's wall clock.</p>
<img src="{e(charts['timeline'])}" alt="per-rank phase timeline">
<h2>Barrier wait per phase and rank</h2>
<p class="note">Total seconds each rank waited at each phase's barrier. Colours run from white (no wait) to the longest
total, but to no less than {WAIT_SCALE_MIN_S:g} s, so waits of milliseconds stay pale.</p>
<img src="{e(charts['barrier_wait'])}" alt="barrier wait per phase and rank">
</body>
</html>
"""
