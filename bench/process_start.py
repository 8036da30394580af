"""An embedded engine's start, with the collector as the orchestrator's processes tune it
(orchestrator/node/collector.py) against CPython's default, in one run.

    python bench/process_start.py                     # about a minute on 2 cores
    python bench/process_start.py --rounds 5 --model /tmp/orch-tools/model

Both start ``orchestrator.engine.server`` on the demo model (made here unless ``--model``
names one) and time it from the process's start to its port file (the imports, the model
loaded, the server listening): ``tuned`` as the rollout starts it (``python -m
orchestrator.engine.server``, whose entry calls ``collector.tune()``), ``default`` the same
``main()`` run from a module import, which leaves the collector as CPython sets it. The two
alternate, ``--rounds`` times each; medians are compared.

Writes JSON (default bench/results/process_start.json).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, machine, python_env, table, write_json  # noqa: E402

WAYS = {
    "tuned": ["-m", "orchestrator.engine.server"],
    "default": ["-c", "import sys; from orchestrator.engine import server; sys.exit(server.main(sys.argv[1:]))"],
}


def start_s(way: str, model: Path, port_file: Path, timeout_s: float = 120) -> float:
    port_file.unlink(missing_ok=True)
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, *WAYS[way], "--model", str(model), "--port", "0", "--port-file", str(port_file)],
                            env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (port_file.exists() and port_file.read_text()):
            if proc.poll() is not None or time.monotonic() - began > timeout_s:
                raise BenchError(f"{way}: the engine did not start (exit {proc.poll()})")
            time.sleep(0.01)
        return time.monotonic() - began
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: the demo's, made here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "process_start.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={work / 'data'}"], check=True,
                           env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            model = work / "data" / "model"
        runs: dict[str, list[float]] = {way: [] for way in WAYS}
        start_s("tuned", model, work / "port")  # the first start reads the files into the page cache: not counted
        for _ in range(args.rounds):
            for way in WAYS:
                runs[way].append(start_s(way, model, work / "port"))
    median = {way: statistics.median(s) for way, s in runs.items()}
    table("an embedded engine's start, s (to its port file)", ["collector", "each run", "median"],
          [[way, ", ".join(f"{s:.2f}" for s in runs[way]), f"{median[way]:.2f}"] for way in WAYS])
    ratio = median["tuned"] / median["default"]
    console.print(f"tuned over default: {ratio:.2f}x the time to start", markup=False)
    write_json(args.out, {"machine": machine(), "runs": runs, "median_s": median, "tuned_over_default": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
