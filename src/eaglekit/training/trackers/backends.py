"""The four trackers behind ``trackers.Backend``; each imports its library when opened (each is an optional extra).

Each is opened with the train folder, the run's name, what reopens its run (``identity``, from train/trackers.json;
empty: a new tracker run) and ``resume_step``: None for a fresh run, the restored checkpoint's step for a resumed
one, -1 for evaluate and verify reopening the run to add their results.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from eaglekit.training.trackers import Backend, flat, project_name


def markdown(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def cells(rows: list[dict]) -> tuple[list, list[list]]:
    """A table's columns and rows, each cell a number or a string (lists and dicts as JSON)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value):
        if value is None or isinstance(value, (int, float, str, bool)):
            return value
        return json.dumps(value)

    return columns, [[cell(row.get(c)) for c in columns] for row in rows]


class TensorBoard(Backend):
    """Event files in train/tensorboard/ (as before report_to). A resumed run purges the events past its
    checkpoint's step (TensorBoard's own purge_step), and every write is flushed, so a kill loses none."""

    name = "tensorboard"

    def __init__(self, folder: Path, run_name: str, identity: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional (tensorboard is an extra)

        purge = resume_step + 1 if resume_step is not None and resume_step >= 0 else None
        self.dir = Path(identity.get("dir") or folder / "tensorboard")
        self.writer = SummaryWriter(str(self.dir), purge_step=purge)
        self.resumed = resume_step is not None and resume_step >= 0

    def identity(self) -> dict:
        return {"dir": str(self.dir)}

    def held_rows(self, handed: int, kept: list[dict], closed: bool) -> int:
        return min(handed, len(kept))  # flushed at every write; the purge dropped the steps past the checkpoint

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def params(self, params: dict) -> None:
        text = "\n".join(f"    {key}: {json.dumps(value)}" for key, value in flat(params).items())
        self.writer.add_text("run/parameters", text, 0)
        self.writer.flush()

    def table(self, name: str, rows: list[dict], step: int) -> None:
        self.writer.add_text(name, markdown(rows), step)
        self.writer.flush()

    def image(self, name: str, path: Path, step: int) -> None:
        import numpy as np  # lazy: heavy (numpy and PIL, for an image alone)
        from PIL import Image  # lazy: heavy (numpy and PIL, for an image alone)

        with Image.open(path) as img:
            pixels = np.asarray(img.convert("RGB"))
        self.writer.add_image(name, pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbApi(Backend):
    """What wandb and trackio (which copies wandb's API) share: ``run.log`` at a step, their own Table and Image
    types, ``run.finish``. A subclass opens ``run`` and sets ``library`` to the module."""

    library: Any
    run: Any

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        columns, data = cells(rows)
        self.run.log({name: self.library.Table(columns=columns, data=data)}, step=step)

    def image(self, name: str, path: Path, step: int) -> None:
        self.run.log({name: self.library.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio(WandbApi):
    """trackio: its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio), or the Space or server its
    variables name. The run is found again by its name in the project."""

    name = "trackio"

    def __init__(self, folder: Path, run_name: str, identity: dict, resume_step: int | None):
        import trackio  # lazy: optional (an extra)

        self.library = trackio
        self.project = identity.get("project") or project_name("trackio")
        self.run_name = identity.get("name") or run_name
        self.run = trackio.init(
            project=self.project,
            name=self.run_name,
            resume="allow" if identity else "never",
            auto_log_cpu=False,
            auto_log_gpu=False,
            embed=False,
        )
        if identity:  # the run's parameters again: trackio keeps the config of a run's latest segment
            from trackio.sqlite_storage import SQLiteStorage  # lazy: optional (an extra)

            before = SQLiteStorage.get_run_config(self.project, self.run_name) or {}
            self.run.config.update({k: v for k, v in before.items() if not k.startswith("_")})

    def identity(self) -> dict:
        return {"project": self.project, "name": self.run_name}

    def held_rows(self, handed: int, kept: list[dict], closed: bool) -> int:
        # trackio writes its store from a background thread: a kill may have lost the last lines handed to it
        from trackio.sqlite_storage import SQLiteStorage  # lazy: optional (an extra)

        logs = SQLiteStorage.get_logs(self.project, self.run_name)
        return min(handed, sum(1 for log in logs if any(k.startswith(("train/", "eval/")) for k in log)))

    def params(self, params: dict) -> None:
        self.run.config.update(flat(params))


class Wandb(WandbApi):
    """Weights & Biases: online with WANDB_API_KEY, or WANDB_MODE=offline (run files under WANDB_DIR, default the
    train folder, for `wandb sync`). The run is resumed by its id."""

    name = "wandb"

    def __init__(self, folder: Path, run_name: str, identity: dict, resume_step: int | None):
        import wandb  # lazy: optional (an extra)

        self.library = wandb
        self.dir = identity.get("dir") or os.environ.get("WANDB_DIR") or str(folder)
        self.run = wandb.init(
            project=identity.get("project") or project_name("wandb"),
            name=run_name,
            id=identity.get("id"),
            resume="allow" if identity else None,
            dir=self.dir,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def identity(self) -> dict:
        return {"id": self.run.id, "project": self.run.project, "dir": self.dir}

    def held_rows(self, handed: int, kept: list[dict], closed: bool) -> int:
        if closed:
            return handed
        # wandb's own process writes the run's history in the background and loses it with a killed run: what it
        # holds is what it reports on resuming (online: the server's steps; offline: none, the new segment gets the
        # restored steps again); a step it holds already it refuses rather than logs twice
        return sum(1 for row in kept if row["step"] < self.run.step)

    def params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        super().close()
        # wandb's own process keeps the run's debug log open after finish(): the next stage's pre-flight would find
        # it writing into the run directory without its lock (`eaglekit run` goes on to evaluate in this process)
        self.library.teardown()


class Mlflow(Backend):
    """MLflow through its client: MLFLOW_TRACKING_URI (a server, or a local store), the experiment
    MLFLOW_EXPERIMENT_NAME (default eaglekit). The run is resumed by its id; its tables are JSON artifacts
    (MLflow's log_table, shown in its UI) and its plots image artifacts."""

    name = "mlflow"

    def __init__(self, folder: Path, run_name: str, identity: dict, resume_step: int | None):
        # a server gone must cost one short failure, not MLflow's default minutes of retries per call
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient  # lazy: optional (an extra)

        self.uri = identity.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = MlflowClient(tracking_uri=self.uri)
        self.uri = self.client.tracking_uri
        if identity.get("run_id"):
            self.run_id = identity["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = project_name("mlflow")
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def identity(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric  # lazy: optional (an extra)

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def params(self, params: dict) -> None:
        from mlflow.entities import Param  # lazy: optional (an extra)

        items = [Param(key, json.dumps(value)[:6000]) for key, value in flat(params).items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def table(self, name: str, rows: list[dict], step: int) -> None:
        columns, data = cells(rows)
        self.client.log_table(self.run_id, {c: [r[i] for r in data] for i, c in enumerate(columns)}, f"{name}.json")

    def image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=str(Path(name).parent))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
