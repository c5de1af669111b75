"""Pre-flight of the experiment trackers train.report_to names (training/trackers): each installed, its server
answering, its credentials present — named by their variable, never shown. A tracker that fails mid-run only warns
(training never stops for one), so a tracker that cannot work is said here, before the long phase, or never."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

import httpx

from eaglekit.contract import StageContext
from eaglekit.preflight import CheckResult, fail, ok, skip
from eaglekit.training.trackers import chosen, installed

TIMEOUT = 5.0  # seconds a tracker's server has to answer


def trackers(ctx: StageContext) -> list[CheckResult]:
    asked = ctx.cfg.train.report_to
    names = chosen(asked)
    if not names:
        words = "train.report_to is []" if asked is not None else "none installed and configured (train.report_to)"
        return [skip("trackers", f"{words}: train/metrics.jsonl only")]
    out = []
    for name in names:
        check = f"tracker {name}"
        if not installed(name):
            out.append(
                fail(
                    check,
                    f"train.report_to names {name}, which is not installed",
                    f"pip install 'eaglekit[{name}]' (or take {name} out of train.report_to)",
                )
            )
            continue
        out.append({"tensorboard": tensorboard, "trackio": trackio, "wandb": wandb, "mlflow": mlflow}[name](check))
    return out


def answers(url: str) -> str | None:
    """None when ``url`` answers over HTTP (any status: the server is there), else why not."""
    try:
        httpx.get(url, timeout=TIMEOUT, follow_redirects=False)
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {str(err) or 'no answer'}"
    return None


def tensorboard(check: str) -> CheckResult:
    return ok(check, "event files in train/tensorboard/ (`tensorboard --logdir RUN_DIR/train/tensorboard`)")


def mlflow(check: str) -> CheckResult:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme = urlparse(uri).scheme
    if not uri:
        return ok(check, "MLFLOW_TRACKING_URI is not set: MLflow's default local store in the working directory")
    if scheme not in ("http", "https"):
        if scheme.startswith("databricks") and not (
            os.environ.get("DATABRICKS_HOST") or Path("~/.databrickscfg").expanduser().exists()
        ):
            return fail(check, f"MLFLOW_TRACKING_URI is {uri} but DATABRICKS_HOST is not set and no ~/.databrickscfg",
                        "set DATABRICKS_HOST and DATABRICKS_TOKEN (or `databricks configure`)")  # fmt: skip
        return ok(check, f"MLflow store {uri}")
    try:
        answer = httpx.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1", timeout=TIMEOUT)
    except httpx.HTTPError as err:
        return fail(
            check,
            f"the MLflow server MLFLOW_TRACKING_URI names ({uri}) does not answer: {type(err).__name__}: {err}",
            "start it (`mlflow server --host HOST --port PORT`), set MLFLOW_TRACKING_URI to one that answers, or take "
            "mlflow out of train.report_to",
        )
    if answer.status_code in (401, 403):
        given = [v for v in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME") if os.environ.get(v)]
        words = (
            f"with {' and '.join(given)} set"
            if given
            else "and neither MLFLOW_TRACKING_TOKEN nor MLFLOW_TRACKING_USERNAME is set"
        )
        return fail(check, f"the MLflow server at {uri} refuses the client (HTTP {answer.status_code}) {words}",
                    "set MLFLOW_TRACKING_TOKEN (or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) to credentials it takes")  # fmt: skip
    return ok(check, f"MLflow server {uri} answers (HTTP {answer.status_code})")


def wandb(check: str) -> CheckResult:
    mode = os.environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        return ok(
            check, f"WANDB_MODE={mode}: run files under the train folder (or WANDB_DIR); `wandb sync` uploads them"
        )
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = urlparse(base).hostname or base
    if not os.environ.get("WANDB_API_KEY") and not in_netrc(host):
        return fail(
            check,
            f"no W&B credentials: WANDB_API_KEY is not set and ~/.netrc has no entry for {host}",
            "set WANDB_API_KEY (or `wandb login`), or WANDB_MODE=offline to keep the run files for `wandb sync`",
        )
    why = answers(base)
    if why:
        return fail(check, f"W&B at {base} does not answer: {why}",
                    "check the network (or WANDB_BASE_URL), or set WANDB_MODE=offline and `wandb sync` later")  # fmt: skip
    source = "WANDB_API_KEY" if os.environ.get("WANDB_API_KEY") else "~/.netrc"
    return ok(check, f"W&B at {base} answers; credentials from {source}")


def in_netrc(host: str) -> bool:
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def trackio(check: str) -> CheckResult:
    space, server = os.environ.get("TRACKIO_SPACE_ID"), os.environ.get("TRACKIO_SERVER_URL")
    if space:
        from huggingface_hub import get_token  # lazy: heavy (huggingface_hub)

        if not get_token():
            return fail(check, f"TRACKIO_SPACE_ID is {space} but no Hugging Face token (HF_TOKEN, `hf auth login`)",
                        "set HF_TOKEN to a token that may write the Space, or unset TRACKIO_SPACE_ID to log locally")  # fmt: skip
        return ok(check, f"Space {space}; a Hugging Face token is present")
    if server:
        base = server.split("?", 1)[0]
        if "write_token" not in server and not os.environ.get("TRACKIO_WRITE_TOKEN"):
            return fail(check, f"TRACKIO_SERVER_URL is {base} but it has no write_token and TRACKIO_WRITE_TOKEN is not set",
                        "set TRACKIO_WRITE_TOKEN (the server's write token, shown by `trackio show`)")  # fmt: skip
        why = answers(base)
        if why:
            return fail(check, f"the trackio server at {base} does not answer: {why}",
                        "start it (`trackio show`), or unset TRACKIO_SERVER_URL to log locally")  # fmt: skip
        return ok(check, f"trackio server {base} answers")
    where = Path(os.environ.get("TRACKIO_DIR") or Path("~/.cache/huggingface/trackio").expanduser())
    probe = where if where.exists() else next((p for p in where.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return fail(
            check, f"trackio's local store {where} is not writable", "set TRACKIO_DIR to a folder you can write"
        )
    return ok(check, f"local store {where} (`trackio show` opens its dashboard)")
