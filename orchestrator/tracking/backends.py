"""The tracking backends: tensorboard, wandb, mlflow. Each opens (or continues) the run's one
tracked run, says which (step, metric) pairs it already holds, read back with the backend's
own reader, and logs a step's figures.

What each holds is read back rather than remembered: the master may be killed between
logging a step and the barrier that would record it, and is then started again; a step
already in the backend's files is not logged twice, and a step the kill lost is logged
again. Every import is here, inside the backend that needs it: the packages are optional
(``orchestrator[tracking]``).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

Logged = dict[int, set[str]]
"""step -> the metric names a backend holds for it."""


class TensorBoard:
    """Event files under ``<log-path>/tracking/tensorboard/``, one more per process that writes."""

    name = "tensorboard"

    def __init__(self, root: Path, run_name: str, project: str, config: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        directory = root / "tensorboard"
        self.where = str(directory)
        self.logged, has_config = tensorboard_logged(directory)
        self.writer = SummaryWriter(log_dir=str(directory))
        if not has_config:
            self.writer.add_text("config", f"run {run_name}\n\n```json\n{json.dumps(config, indent=1)}\n```", 0)
            self.writer.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # durable now: a kill after this loses nothing

    def close(self) -> None:
        self.writer.close()


def tensorboard_logged(directory: Path) -> tuple[Logged, bool]:
    """The scalars every event file under ``directory`` holds, by step, read with
    tensorboard's own reader; and whether the config text is there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged: Logged = {}
    if not directory.is_dir():
        return logged, False
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        for event in acc.Scalars(tag):
            logged.setdefault(event.step, set()).add(tag)
    return logged, any(t.startswith("config") for t in tags.get("tensors", []))


def _wandb_mode() -> str:
    """``WANDB_MODE`` when set; else online when this machine is logged in to wandb (an API
    key in the environment or in ~/.netrc), offline otherwise."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class Wandb:
    """A wandb run under ``<log-path>/tracking/wandb/``, the same run id across resumes
    (``resume="allow"``); offline unless logged in, so ``wandb sync`` uploads it later."""

    name = "wandb"

    def __init__(self, root: Path, run_name: str, project: str, config: dict, ids: dict):
        import wandb

        self.mode = _wandb_mode()
        run_id = ids.get("wandb") or uuid.uuid4().hex[:12]
        ids["wandb"] = run_id
        root.mkdir(parents=True, exist_ok=True)
        self.logged = wandb_logged(root / "wandb", run_id)  # wandb writes under <dir>/wandb/
        self.run = wandb.init(project=project, name=run_name, id=run_id, dir=str(root), mode=self.mode, resume="allow",
                              config=config, settings=wandb.Settings(console="off", silent=True))
        self.where = f"{root / 'wandb'} ({self.mode}, run id {run_id})"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_logged(directory: Path, run_id: str) -> Logged:
    """The history every local file of run ``run_id`` holds (``run-<id>.wandb`` of each
    start of it, offline or online), by step, read with wandb's own reader (``wandb leet
    inspect --json``)."""
    logged: Logged = {}
    for run_file in sorted(directory.glob(f"*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_records(run_file):
            history = record.get("history") if record.get("type") == "history" else None
            if not history:
                continue
            step = (history.get("step") or {}).get("num", 0)
            logged.setdefault(int(step), set()).update(k for k in history.get("item", {}) if not k.startswith("_"))
    return logged


def wandb_records(run_file: Path) -> list[dict]:
    """The records of one ``.wandb`` file, as ``wandb leet inspect --json`` prints them."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {run_file} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


MLFLOW_PARAMS_PER_BATCH = 100  # mlflow's limit per log_batch call


class MLflow:
    """An mlflow run in ``MLFLOW_TRACKING_URI``, else in a file store under
    ``<log-path>/tracking/mlflow/`` (mlflow 3 keeps that store in maintenance mode and asks
    for ``MLFLOW_ALLOW_FILE_STORE=true``, set here for it); the same run across resumes."""

    name = "mlflow"

    def __init__(self, root: Path, run_name: str, project: str, config: dict, ids: dict):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (root / "mlflow").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run = None
        if ids.get("mlflow"):
            try:
                run = self.client.get_run(ids["mlflow"])
            except MlflowException as e:  # another tracking URI than before, or the run deleted
                log.warning("mlflow: run %s of this run's earlier starts is not in %s (%s): a new run starts", ids["mlflow"], uri, e)
        if run is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run = self.client.create_run(experiment_id, run_name=run_name)
            ids["mlflow"] = run.info.run_id
        self.run_id = run.info.run_id
        self.where = f"{uri} (run id {self.run_id})"
        self.logged = mlflow_logged(self.client, self.run_id)
        if not run.data.params:
            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_logged(client, run_id: str) -> Logged:
    """Every metric's steps in the run, by step, from mlflow's client."""
    logged: Logged = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            logged.setdefault(m.step, set()).add(key)
    return logged


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


BACKENDS = {backend.name: backend for backend in (TensorBoard, Wandb, MLflow)}


def open_backend(name: str, root: Path, run_name: str, project: str, config: dict, ids: dict):
    """The backend ``name``, opened (or continued: ``ids`` holds the tracked runs' ids, and
    gains a new run's) under ``root`` (``<log-path>/tracking``); raises whatever its package raises."""
    return BACKENDS[name](root, run_name, project, config, ids)
