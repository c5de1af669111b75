"""`eaglekit publish`: the demo's drafter with its model card, refused where it would mislead, and uploaded to a
stand-in for the Hub on 127.0.0.1 (tests/support/local_hub.py; the real Hub cannot be reached from these machines) through
huggingface_hub's own client."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.local_hub import LocalHub

pytestmark = pytest.mark.slow  # reads the demo run (conftest.demo_run)

VERIFIER = "eaglekit-tests/tiny-target"  # a hub id: the card's base_model


def copy_run(demo_run, tmp_path: Path, **export: str) -> Path:
    """A copy of the demo's run directory (the demo's own stays as the other tests read it)."""
    run = tmp_path / "run"
    shutil.copytree(demo_run[0], run, ignore=shutil.ignore_patterns("publish", ".lock"))
    if export:
        config = run / "config.yaml"
        cfg = yaml.safe_load(config.read_text())
        cfg.setdefault("export", {}).update(export)
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


@pytest.fixture(scope="module")
def published_run(demo_run, tmp_path_factory):
    """The demo run exported again for a hub-id verifier (seconds: nothing is retrained)."""
    from eaglekit.cli import main

    run = copy_run(demo_run, tmp_path_factory.mktemp("publish"), verifier=VERIFIER)
    try:
        main(["export", str(run / "config.yaml"), "--force"])  # export.verifier changed
    except SystemExit as done:
        assert done.code in (0, None), done.code
    return run


def test_a_local_verifier_is_refused_with_the_key_to_set(demo_run, tmp_path, cli):
    run = copy_run(demo_run, tmp_path)
    result = cli("publish", run, "--repo", "me/tiny-eagle3", "--dry-run")
    assert result.code == 2
    assert "local folder" in result.err and "export.verifier" in result.err
    assert "eaglekit export" in result.err and "--force" in result.err  # the remedy: re-export, nothing retrained
    assert not (run / "publish").exists()


def test_a_failed_verify_is_refused_unless_published_unverified(demo_run, tmp_path, cli):
    run = copy_run(demo_run, tmp_path)
    report_path = run / "verify" / "report.json"
    if not report_path.exists():
        pytest.skip("the demo ran without verify (no .venv-vllm)")
    report = json.loads(report_path.read_text())
    report_path.write_text(json.dumps({**report, "verdict": "FAIL"}))
    refused = cli("publish", run, "--repo", "me/tiny-eagle3", "--dry-run")
    assert refused.code == 1
    assert "verify FAILed" in refused.err and "--unverified" in refused.err
    # --unverified passes that check and stops at the next one (the verifier is still a local folder)
    unverified = cli("publish", run, "--repo", "me/tiny-eagle3", "--dry-run", "--unverified")
    assert unverified.code == 2 and "export.verifier" in unverified.err


def test_a_stale_export_is_refused(published_run, tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(published_run, run, ignore=shutil.ignore_patterns("publish", ".lock"))
    config = run / "config.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["export"]["verifier"] = "eaglekit-tests/another-target"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = cli("publish", run, "--repo", "me/tiny-eagle3", "--dry-run")
    assert result.code == 2 and "stale" in result.err and "eaglekit run" in result.err


def test_a_damaged_export_is_refused_naming_the_file(published_run, tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(published_run, run, ignore=shutil.ignore_patterns("publish", ".lock"))
    weights = run / "export" / "eagle3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])  # same size, other bytes
    weights.write_bytes(bytes(data))
    result = cli("publish", run, "--repo", "me/tiny-eagle3", "--dry-run", "--form", "eagle3")
    assert result.code == 1
    assert "model.safetensors" in result.err and "eaglekit export" in result.err


def test_non_finite_weights_are_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    from eaglekit.errors import EaglekitError
    from eaglekit.publish import refuse_non_finite

    save_file(
        {"fc.weight": torch.tensor([[1.0, float("nan")]]), "d2t": torch.tensor([0, 1])}, tmp_path / "m.safetensors"
    )
    with pytest.raises(EaglekitError, match="fc.weight"):
        refuse_non_finite(tmp_path)
    save_file({"fc.weight": torch.ones(2, 2)}, tmp_path / "m.safetensors")
    refuse_non_finite(tmp_path)


def test_dry_run_writes_the_folder_with_a_card_the_hub_parses(published_run, cli):
    from huggingface_hub import ModelCard

    result = cli("publish", published_run, "--repo", "me/tiny-eagle3", "--dry-run", "--json", "--license", "mit")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    folder = Path(doc["folder"])
    assert "commit_url" not in doc  # nothing uploaded
    form = published_run / "export" / doc["form"]
    for path in form.iterdir():
        if path.is_file() and not path.name.startswith("."):
            assert (folder / path.name).read_bytes() == path.read_bytes(), path.name
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == VERIFIER
    assert card.data.license == "mit"
    assert "speculative-decoding" in card.data.tags
    # the τ the run measured, by K, and serve commands that name the hub ids, not this machine's folders
    evaluate_table = (published_run / "evaluate" / "report.md").read_text().split("| eagle | 1 |")[1].split("\n")[0]
    assert f"| eagle | 1 |{evaluate_table}" in card.text
    assert str(published_run) not in card.text
    assert "me/tiny-eagle3" in card.text and VERIFIER in card.text
    # verify ran on the export before this one: the card does not borrow its figures
    assert "Not verified in a serving engine" in card.text
    # only the published form's commands: the repository holds no other
    assert "speculators/" not in card.text or doc["form"] == "speculators"


def test_the_card_carries_verify_figures_and_the_engine_settings(demo_run):
    from huggingface_hub import ModelCard

    from eaglekit.config import load_config
    from eaglekit.publish import card_text

    run = demo_run[0]
    if not (run / "verify" / "report.json").exists():
        pytest.skip("the demo ran without verify (no .venv-vllm)")
    report = json.loads((run / "verify" / "report.json").read_text())
    cfg = load_config(run / "config.yaml")
    text = card_text(
        cfg, repo="me/x", form="eagle3", verifier=VERIFIER, license_=None, verified="PASS", verify_report=report
    )
    ModelCard(text)
    assert "verify: **PASS**" in text and report["engine_version"] in text
    assert "`rejection_sample_method` 'standard'" in text and "Drafts per verify pass" in text
    assert text.count("## Served (eaglekit verify)") == 1


def test_upload_through_the_hub_client_sends_the_folder_once(published_run, tmp_path, cli, monkeypatch):
    with LocalHub(repos={}, uploads=tmp_path / "hub", token="secret-token") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("EAGLEKIT_TEST_HF_TOKEN", raising=False)
        refused = cli("publish", published_run, "--repo", "me/tiny-eagle3", "--token-env", "EAGLEKIT_TEST_HF_TOKEN")
        assert refused.code == 1 and "EAGLEKIT_TEST_HF_TOKEN" in refused.err and "secret-token" not in refused.err

        monkeypatch.setenv("EAGLEKIT_TEST_HF_TOKEN", "secret-token")
        result = cli(
            "publish", published_run, "--repo", "me/tiny-eagle3", "--token-env", "EAGLEKIT_TEST_HF_TOKEN", "--json"
        )
        assert result.code == 0, result.err
        doc = json.loads(result.out)
        assert doc["commit_url"].startswith(hub.url)
        folder = Path(doc["folder"])
        uploaded = hub.repos["me/tiny-eagle3"]
        assert sorted(p.name for p in uploaded.iterdir()) == sorted(doc["files"])
        for name in doc["files"]:
            assert (uploaded / name).read_bytes() == (folder / name).read_bytes(), name

        # a second publish of the same folder sends nothing the Hub already holds
        commits = len(hub.committed)
        again = cli("publish", published_run, "--repo", "me/tiny-eagle3", "--token-env", "EAGLEKIT_TEST_HF_TOKEN")
        assert again.code == 0, again.err
        assert len(hub.committed) == commits
        assert hub.validated and all(text.startswith("---\nbase_model: ") for text in hub.validated)
