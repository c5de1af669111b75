"""`eaglekit publish RUN_DIR --repo ORG/NAME`: one exported form of a finished run, with a model card, uploaded to
the Hugging Face Hub (or, with ``--dry-run``, written where it can be read first).

The folder to upload is assembled under ``RUN_DIR/publish/<form>/``: the form's files as export wrote them and a
``README.md`` that is the model card — Hub front matter (``base_model`` = the verifier's hub id, ``library_name``,
tags, license), then export's own card (the drafter, the training data, τ by K, temperature and context group, the
serve commands, the run's warnings) with this machine's paths replaced by the hub ids, and verify's served figures
with the engine they were measured in. ``--dry-run`` writes exactly that folder and uploads nothing.

It refuses, naming why and the remedy, a drafter that would mislead whoever downloads it: export not done or stale
against its config, damaged files, non-finite weights, a verify that FAILed (unless ``--unverified``, which the card
then says), or a verifier that is a local folder (the card's ``base_model`` and the speculators config would point
nowhere). The upload goes through ``huggingface_hub`` (create the repo, upload the folder; a rerun sends only what
the Hub does not hold yet), reading ``HF_ENDPOINT`` and the token variable when called.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from eaglekit import atomic, status
from eaglekit.config import RunConfig
from eaglekit.data.verify_report import CARD_HEADING, card_markdown
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.hub import is_hub_id, split_id

CARD = "README.md"
# the Hub's library for each form: the library whose loader reads the folder as it is
LIBRARY = {"speculators": "speculators", "sglang": "sglang"}
ENGINE_LIBRARY = "vllm"  # the plain forms: vLLM's --speculative-config reads them (SGLang too, for EAGLE-3)


@dataclass(frozen=True)
class Publication:
    """What publish assembled: the folder uploaded as it is, and what its card says."""

    folder: Path
    repo: str
    form: str
    verified: str  # "PASS", "FAIL (published with --unverified)" or "not run"
    files: list[str]


def _export_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "export"


def _state_of(cfg: RunConfig, stage: str) -> dict | None:
    return next((row for row in status.stage_rows(cfg) if row["stage"] == stage), None)


def refuse_unfinished(cfg: RunConfig, config: str) -> None:
    """Export must be done with the config's current parameters (its drafter is what the card describes)."""
    row = _state_of(cfg, "export")
    if row is None or row["state"] == "pending":
        raise UsageError(
            f"nothing to publish: export has not run in {cfg.run_dir}",
            f"run `eaglekit run {config}` (or `eaglekit export {config}` once train and evaluate are done)",
        )
    if row["state"] == "stale":
        raise UsageError(
            f"the exported drafter in {_export_dir(cfg)} is stale against {config}: {row['reason']}",
            f"run `eaglekit run {config}`: it reruns only what changed, then publish what it exports",
        )
    if row["state"] != "done":
        raise UsageError(
            f"export is {row['state']} in {cfg.run_dir}" + (f": {row['error']}" if row.get("error") else ""),
            f"run `eaglekit export {config}` until it is done",
        )


def verifier_hub_id(cfg: RunConfig, config: str) -> str:
    """The verifier the drafter is published for: a hub id, never a folder of this machine."""
    verifier = cfg.export.verifier or cfg.target.model
    if not is_hub_id(verifier):
        raise UsageError(
            f"the verifier is the local folder {verifier}: a published drafter's base_model and its speculators "
            "config must name a model others can download",
            f"set export.verifier to the target's hub id in {config}, then `eaglekit export {config} --force` "
            "(seconds: it rewrites the configs, nothing is retrained) and publish again; `eaglekit run "
            f"{config}` verifies the new export in the engine first",
        )
    return split_id(verifier)[0]


def refuse_non_finite(form_dir: Path) -> None:
    """Every tensor of the form's weights finite (a NaN drafter serves at τ = 1 without an error)."""
    import torch  # lazy: heavy (torch)

    for path in sorted(form_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118  (safe_open has keys(), no iteration)
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise EaglekitError(
                        f"{path} holds non-finite values in {name}: the drafter would accept nothing",
                        "train again from the last finite checkpoint (`eaglekit status` names it) and export",
                    )


def verify_outcome(cfg: RunConfig, unverified: bool) -> tuple[str, dict | None]:
    """verify's verdict for the card; a FAIL refuses unless ``unverified``."""
    report_path = Path(cfg.run_dir) / "verify" / "report.json"
    row = _state_of(cfg, "verify")
    if row is None or row["state"] != "done" or not report_path.exists():
        return "not run", None
    report = json.loads(report_path.read_text(encoding="utf-8"))
    verdict = str(report.get("verdict", "")).upper()
    if verdict == "PASS":
        return "PASS", report
    if not unverified:
        raise EaglekitError(
            f"verify FAILed for this drafter ({report_path}): the engine accepts less than eaglekit measured",
            "read verify/report.md for the likely cause and fix it; or publish with --unverified, which the model "
            "card then states",
        )
    return "FAIL (published with --unverified)", report


def target_license(cfg: RunConfig) -> str | None:
    """The license the target's own card declares (the front matter of its README.md), if its folder is at hand."""
    card = Path(cfg.target.model) / CARD
    if not card.is_file():
        return None
    from huggingface_hub import ModelCard  # lazy: heavy (huggingface_hub)

    license_ = ModelCard.load(card).data.license
    return str(license_) if license_ else None


def card_text(
    cfg: RunConfig,
    *,
    repo: str,
    form: str,
    verifier: str,
    license_: str | None,
    verified: str,
    verify_report: dict | None,
) -> str:
    """The model card: Hub front matter, then export's card with this machine's paths as hub ids, then verify."""
    from huggingface_hub import ModelCard, ModelCardData  # lazy: heavy (huggingface_hub)

    family = _family_tag(cfg)
    data = ModelCardData(
        base_model=verifier,
        library_name=LIBRARY.get(form, ENGINE_LIBRARY),
        license=license_,
        tags=["speculative-decoding", "draft-model", family, "eaglekit"],
    )
    body = for_the_hub((_export_dir(cfg) / CARD).read_text(encoding="utf-8"), cfg, form, repo, verifier)
    # verify's figures as they stand now (export's card holds them only when verify had run before it)
    body = without_section(body, CARD_HEADING)
    if verify_report is None:
        served = (
            f"{CARD_HEADING}\n\nNot verified in a serving engine: the τ above is eaglekit's offline measurement only.\n"
        )
    else:
        served = card_markdown(verify_report, form)
        if verified != "PASS":
            served += f"\n**Published unverified**: verify's verdict was {verified.split(' ')[0]}.\n"
    text = f"---\n{data.to_yaml()}\n---\n\n{body.rstrip()}\n\n{served}"
    ModelCard(text)  # parses as the Hub parses it: a card it would refuse fails here, before any upload
    return text


def for_the_hub(body: str, cfg: RunConfig, form: str, repo: str, verifier: str) -> str:
    """Export's card as the Hub shows it: the hub ids for this machine's folders, the run's own files by their place
    in the run directory, and only what serves the form that is uploaded (the other forms are not in the repo)."""
    others = [
        str(p) for p in _export_dir(cfg).iterdir() if p.is_dir() and p.name != form and (p / "config.json").is_file()
    ]
    chunks = body.split("\n\n")
    kept: list[str] = []
    for chunk in chunks:
        if any(other in chunk for other in others):
            if kept and kept[-1].rstrip().endswith(":"):  # the line that introduced the dropped command
                kept.pop()
            continue
        lines = chunk.split("\n")
        kept.append(
            "\n".join(line for line in lines if not any(line.startswith(f"- `{Path(o).name}/`") for o in others))
        )
    text = "\n\n".join(kept)
    for local, published in (
        (str(_export_dir(cfg) / form), repo),
        (str(cfg.target.model), verifier),
        (f"`{verifier}` (hub id `{verifier}`)", f"`{verifier}`"),
        (str(cfg.run_path) + "/", ""),
    ):
        text = text.replace(local, published)
    # a checkpoint outside the run directory: its folder's name says which it was; its path is this machine's
    return re.sub(r"Source checkpoint: `(/[^`]+)`", lambda m: f"Source checkpoint: `{Path(m.group(1)).name}`", text)


def without_section(markdown: str, heading: str) -> str:
    """``markdown`` less the section under ``heading`` (up to the next heading of its level)."""
    lines, out, skipping = markdown.splitlines(), [], False
    level = heading.split(" ")[0] + " "
    for line in lines:
        if line == heading:
            skipping = True
        elif skipping and line.startswith(level):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def _family_tag(cfg: RunConfig) -> str:
    """The family's Hub tag: the trained family's name (EAGLE-3's two layer kinds share one tag). Read from the run,
    not from the exported config: a DFlash2 config reads as DFlash to an engine without its path selector."""
    from eaglekit.drafters.registry import family_of_run  # lazy: heavy (torch, the families' models)

    name = family_of_run(cfg).name
    return "eagle3" if name in ("llama", "mla") else name


def assemble(
    cfg: RunConfig,
    *,
    repo: str,
    form: str | None,
    config: str,
    license_: str | None = None,
    unverified: bool = False,
) -> Publication:
    """Check the run, then write ``RUN_DIR/publish/<form>/`` (the folder uploaded as it is)."""
    if not is_hub_id(repo) or "@" in repo:
        raise UsageError(f"--repo {repo!r} is not a hub repository id", "name it as ORG/NAME, e.g. my-org/llama-eagle3")
    refuse_unfinished(cfg, config)
    forms = sorted(p.name for p in _export_dir(cfg).iterdir() if (p / "config.json").is_file())
    chosen = form or forms[0]
    if chosen not in forms:
        raise UsageError(f"--form {chosen} was not exported in {_export_dir(cfg)}", f"use one of {', '.join(forms)}")
    form_dir = _export_dir(cfg) / chosen
    atomic.refuse_damaged(form_dir, "the exported drafter", f"run `eaglekit export {config}`: it rewrites the form")
    refuse_non_finite(form_dir)
    verified, report = verify_outcome(cfg, unverified)
    verifier = verifier_hub_id(cfg, config)
    card = card_text(
        cfg,
        repo=repo,
        form=chosen,
        verifier=verifier,
        license_=license_ or target_license(cfg),
        verified=verified,
        verify_report=report,
    )
    out = Path(cfg.run_dir) / "publish" / chosen
    with atomic.atomic_dir(out) as tmp:
        for path in sorted(form_dir.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                shutil.copy2(path, tmp / path.name)
        (tmp / CARD).write_text(card, encoding="utf-8")
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    return Publication(folder=out, repo=repo, form=chosen, verified=verified, files=files)


def upload(publication: Publication, *, private: bool, token_env: str = "HF_TOKEN") -> str:
    """Create the repo (or reuse it) and upload the folder in one commit; the commit's URL."""
    from huggingface_hub import HfApi  # lazy: heavy (huggingface_hub)
    from huggingface_hub.errors import HfHubHTTPError  # lazy: heavy (huggingface_hub)

    token = os.environ.get(token_env) or None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(publication.repo, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(publication.folder),
            repo_id=publication.repo,
            repo_type="model",
            commit_message=f"eaglekit: {publication.form} drafter",
        )
    except HfHubHTTPError as err:
        status_code = err.response.status_code if err.response is not None else None
        remedy = (
            f"set {token_env} to a token with write access to {publication.repo} (the variable's name, never the "
            "token, goes in commands)"
            if status_code in (401, 403)
            else "publish again: the Hub keeps what it received and the rerun sends the rest"
        )
        raise EaglekitError(f"the Hub refused the upload to {publication.repo}: {err}", remedy) from None
    except OSError as err:  # connection refused, DNS, TLS: the network, not the drafter
        raise EaglekitError(
            f"could not reach the Hub at {endpoint or 'huggingface.co'}: {err}",
            "check the network (or HF_ENDPOINT), then publish again; the folder stays assembled",
        ) from None
    return str(getattr(commit, "commit_url", commit))


def summary(publication: Publication) -> dict:
    return {
        "repo": publication.repo,
        "form": publication.form,
        "folder": str(publication.folder),
        "files": publication.files,
        "verified": publication.verified,
        "bytes": sum((publication.folder / f).stat().st_size for f in publication.files),
    }
