"""`eaglekit plan`: the Kimi-K2.5-sized run that does not fit a 2.8 TB volume, the alternatives, figures measured by a
pilot in the ledger, the disk's write rate, and what stays unknown."""

from __future__ import annotations

import json
import os

import pytest
from support.helpers import write_config

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.data.shards import bytes_per_token
from eaglekit.planning import parse_bytes

# The shape of Kimi-K2.5's language model (DeepSeek-V3 architecture); plan needs its config.json only, no weights.
KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "intermediate_size": 18432,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def kimi_config(tmp_path, **sections):
    target = tmp_path / "Kimi-K2.5"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(KIMI))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    data = {
        "run_dir": "run",
        "target": {"model": "Kimi-K2.5"},
        "data": {"prompts": "prompts.jsonl"},
        "extract": {"mode": "offline", "dtype": "bfloat16"},
        "vocab": {"draft_vocab_size": 32000},
        "preflight": {"disk_probe_mb": 4},
        **sections,
    }
    return write_config(tmp_path / "kimi.yaml", data)


def stage(doc, name):
    return next(s for s in doc["stages"] if s["stage"] == name)


def test_25k_samples_of_4k_tokens_with_offline_bf16_features_do_not_fit_2_8_tb(tmp_path, cli):
    r = cli(
        "plan", kimi_config(tmp_path), "--samples", "25000", "--mean-tokens", "4000", "--free-bytes", "2.8TB", "--json"
    )
    assert r.code == 1
    doc = json.loads(r.out)
    assert doc["verdict"] == "does not fit" and doc["free_bytes"] == 2.8e12
    assert bytes_per_token(7168, "bfloat16") == 57_344
    extract = stage(doc, "extract")
    assert 5.73e12 <= extract["bytes"] <= 5.74e12  # ≈5.7 TB of features
    assert extract["verdict"] == "does not fit" and "57,344 B/tok" in extract["how"][0]
    assert [s["verdict"] for s in doc["stages"][:3]] == ["fits"] * 3  # generate, prepare, vocab fit

    alt = {a["option"]: a for a in doc["alternatives"]}
    assert 11_500 <= alt["fewer samples"]["samples_that_fit"] <= 12_250  # ≈12,000 samples would
    assert alt["online features"]["verdict"] == "fits"
    fp8 = alt["8-bit features"]
    assert f"{bytes_per_token(7168, 'fp8'):,} B/token" in fp8["how"]
    assert (
        fp8["peak_bytes"] < 0.55 * doc["peak_bytes"]
        and fp8["samples_that_fit"] > alt["fewer samples"]["samples_that_fit"]
    )
    assert doc["inputs"]["samples"]["source"] == "flag --samples"
    assert doc["inputs"]["hidden_size"]["value"] == 7168


def test_the_human_plan_shows_the_arithmetic_and_the_verdict(tmp_path, cli):
    r = cli("plan", kimi_config(tmp_path), "--samples", "25000", "--mean-tokens", "4000", "--free-bytes", "2.8TB")
    assert r.code == 1
    text = " ".join(r.err.split())
    for piece in ("does not fit", "5.7 TB", "2.8 TB", "alternatives", "online features", "8-bit features"):
        assert piece in text, piece


def test_the_free_space_of_the_run_directorys_disk_is_measured(tmp_path, cli, monkeypatch):
    real = os.statvfs

    class Volume:  # a 2.8 TB volume under the run directory
        f_frsize, f_bavail, f_files, f_favail = 4096, int(2.8e12 // 4096), 10**8, 10**8

    monkeypatch.setattr(os, "statvfs", lambda p: Volume() if str(p).startswith(str(tmp_path)) else real(p))
    r = cli(
        "plan",
        kimi_config(tmp_path),
        "--samples",
        "25000",
        "--mean-tokens",
        "4000",
        "--json",
        "--write-mb-per-s",
        "500",
    )
    doc = json.loads(r.out)
    assert r.code == 1 and doc["verdict"] == "does not fit"
    assert doc["inputs"]["free_bytes"]["source"].startswith("counted: free on")


def test_enough_space_fits_with_times_from_the_rates_given(tmp_path, cli):
    r = cli(
        "plan",
        kimi_config(tmp_path),
        "--samples",
        "1000",
        "--mean-tokens",
        "4000",
        "--free-bytes",
        "10TB",
        "--gen-tok-per-s",
        "20000",
        "--extract-tok-per-s",
        "40000",
        "--train-tok-per-s",
        "50000",
        "--write-mb-per-s",
        "10000",
        "--json",
    )
    doc = json.loads(r.out)
    assert r.code == 0 and doc["verdict"] == "fits" and doc["alternatives"] == []
    gen, ext, train = stage(doc, "generate"), stage(doc, "extract"), stage(doc, "train")
    assert gen["seconds"] == pytest.approx(1000 * 512 / 20000)  # reply tokens assumed min(max_tokens, 4000)
    assert ext["seconds"] == pytest.approx(1000 * 4000 / 40000)
    assert ext["need_write_rate"] == pytest.approx(40000 * 57_344)
    assert train["seconds"] == pytest.approx(1000 * 4000 * 0.95 / 50000)


def test_a_disk_slower_than_extract_makes_it_disk_bound(tmp_path, cli):
    r = cli(
        "plan",
        kimi_config(tmp_path),
        "--samples",
        "1000",
        "--mean-tokens",
        "4000",
        "--free-bytes",
        "10TB",
        "--extract-tok-per-s",
        "40000",
        "--write-mb-per-s",
        "500",
        "--json",
    )
    ext = stage(json.loads(r.out), "extract")
    assert any("disk-bound" in h for h in ext["how"])
    assert ext["seconds"] == pytest.approx(ext["bytes"] / 500e6)


def pilot_ledger(cfg):
    """What a 10-sample pilot of this config leaves in the ledger."""
    run = pipeline.RunDir(cfg.run_dir)
    ends = {
        "generate": {"counts": {"new": 10}, "rates": {"output_tok_per_s": 800.0, "mean_output_tokens": 300.0}},
        "prepare": {"counts": {"samples": 10, "mean_length": 350.0}, "seconds": 2.0},
        "vocab": {"counts": {}, "seconds": 1.0},
        "extract": {"counts": {"tokens": 3500, "tokens_per_s": 1750.0}},
        "train": {"counts": {"steps": 20, "tokens": 7000, "seconds": 7.0}},
    }
    for stage_name, end in ends.items():
        fp = pipeline.fingerprint(cfg, stage_name)
        run.append_event({"stage": stage_name, "event": "start", "fingerprint": fp})
        run.append_event({"stage": stage_name, "event": "end", "state": "done", "fingerprint": "pilot-" + fp, **end})


def test_a_pilots_measurements_are_scaled_to_the_planned_run(tmp_path, cli):
    path = kimi_config(tmp_path)
    pilot_ledger(load_config(path))
    doc = json.loads(cli("plan", path, "--samples", "2000", "--free-bytes", "10TB", "--json").out)
    inputs = doc["inputs"]
    for name in ("mean_tokens", "output_tokens", "gen_tok_per_s", "extract_tok_per_s", "train_tok_per_s"):
        assert inputs[name]["source"].startswith("measured:"), (name, inputs[name])
    assert stage(doc, "generate")["seconds"] == pytest.approx(2000 * 300 / 800)
    assert stage(doc, "prepare")["seconds"] == pytest.approx(2.0 / 10 * 2000)
    assert stage(doc, "extract")["bytes"] >= 2000 * 350 * 57_344
    assert inputs["train_tok_per_s"]["value"] == 1000.0
    # a flag overrides what the pilot measured
    doc = json.loads(
        cli("plan", path, "--samples", "2000", "--mean-tokens", "999", "--free-bytes", "10TB", "--json").out
    )
    assert doc["inputs"]["mean_tokens"] == {"value": 999.0, "source": "flag --mean-tokens"}


def test_without_the_targets_config_the_features_are_unknown_not_guessed(tmp_path, cli):
    path = kimi_config(tmp_path, target={"model": "org/not-here"})
    r = cli("plan", path, "--samples", "100", "--mean-tokens", "100", "--free-bytes", "1TB", "--json")
    doc = json.loads(r.out)
    assert r.code == 0 and doc["verdict"] == "unknown"
    assert stage(doc, "extract")["bytes"] is None and stage(doc, "extract")["verdict"] == "unknown"
    assert doc["inputs"]["hidden_size"]["value"] is None


def test_sizes_parse_in_decimal_and_binary_units(cli, tmp_path):
    assert parse_bytes("2.8TB") == parse_bytes("2.8 T") == 2_800_000_000_000
    assert parse_bytes("500GB") == 500 * 10**9 and parse_bytes("2TiB") == 2 * 2**40 and parse_bytes("1234") == 1234
    with pytest.raises(ValueError):
        parse_bytes("lots")
    r = cli("plan", kimi_config(tmp_path), "--free-bytes", "lots")
    assert r.code == 2 and "--free-bytes" in r.err


def test_streaming_is_recommended_where_offline_features_do_not_fit(tmp_path, cli):
    """The 25,000 × 4,000 Kimi run on 2.8 TB: streaming from vLLM servers fits (disk: the spool, not 5.7 TB of
    features) and is the recommendation; with the config in stream mode the plan fits, train's disk is the spool
    and its time the slower of the trainer and the servers."""
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    flags = ["--samples", "25000", "--mean-tokens", "4000", "--free-bytes", "2.8TB"]
    rates = ["--extract-tok-per-s", "20000", "--train-tok-per-s", "50000"]
    r = cli("plan", kimi_config(tmp_path / "a"), *flags, *rates, "--json")
    doc = json.loads(r.out)
    alternatives = {a["option"]: a for a in doc["alternatives"]}
    stream = alternatives["stream features"]
    assert stream["verdict"] == "fits" and stream["peak_bytes"] < 0.02 * doc["peak_bytes"]  # checkpoints and the spool
    assert stream["peak_bytes"] - alternatives["online features"]["peak_bytes"] == pytest.approx(4e9, rel=1e-3)
    assert "extract.mode: stream" in stream["how"] and "spool_gb: 4" in stream["how"]
    assert doc["recommendation"].startswith("stream features: extract.mode: stream")

    streamed = kimi_config(
        tmp_path / "b",
        extract={
            "mode": "stream",
            "backend": "vllm",
            "stream": {"spool_gb": 200},
            "vllm": {"servers": ["http://127.0.0.1:1/v1"], "storage_path": "/shared/hs"},
        },
    )
    r = cli("plan", streamed, *flags, *rates, "--json")
    assert r.code == 0, r.out
    doc = json.loads(r.out)
    assert doc["verdict"] == "fits" and "extract" not in [s["stage"] for s in doc["stages"]]
    train = stage(doc, "train")
    assert train["bytes"] >= 200e9 and any(line.startswith("spool: 200.0 GB") for line in train["how"])
    tokens = 25000 * 4000
    servers = (tokens * 0.95 * 1 + tokens * 0.05) / 20000  # one epoch (the default) asked, plus the held-out rows
    assert train["seconds"] == pytest.approx(max(tokens * 0.95 / 50000, servers), rel=1e-6)
    assert any("server-bound" in line for line in train["how"])
    r = cli("plan", streamed, *flags, *rates)
    assert "time 1h23m" in r.err  # the servers: 10^8 tokens ÷ 20,000 tok/s; the trainer alone would take 32 min

    # through Mooncake the servers write no files: no spool on this volume
    mooncake = kimi_config(
        tmp_path / "c",
        extract={
            "mode": "stream",
            "backend": "vllm",
            "stream": {"spool_gb": 200, "transport": "mooncake"},
            "vllm": {"servers": ["http://127.0.0.1:1/v1"]},
        },
    )
    r = cli("plan", mooncake, *flags, *rates, "--json")
    assert r.code == 0, r.out
    train = stage(json.loads(r.out), "train")
    assert train["bytes"] < 200e9 and any(line.startswith("no spool") for line in train["how"])
