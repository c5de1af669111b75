"""Model-file checks on real safetensors files: each way a file can be damaged, a sharded index out of step with
its shards, quantized tensors the drafter copies — and the healthy tiny target raising no alarm."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data import shards as sh
from eaglekit.preflight import files


def write_sharded(folder: Path, config: dict | None = None, shards: int = 2) -> Path:
    """A small Llama-named checkpoint in ``shards`` files with its index, as save_pretrained writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g, dtype=torch.float32).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
    }
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / shard), metadata={"format": "pt"})
        weight_map |= {k: shard for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 16}))
    return folder


def rewrite_header(path: Path, edit) -> None:
    """Change a safetensors header, keeping the tensor bytes as they were."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def problems_of(folder: Path) -> list[str]:
    return files.read_weights(folder).problems


def test_a_healthy_sharded_checkpoint_has_no_problem(tmp_path):
    w = files.read_weights(write_sharded(tmp_path / "m"))
    assert w.problems == [] and len(w.headers) == 2 and len(w.tensors()) == 5
    result = files.weights_result("target weights", w, "the target")
    assert result.status == "ok" and "2 safetensors files, 5 tensors" in result.detail


def test_a_shard_truncated_by_4_kb_fails_naming_the_file_and_the_missing_bytes(tmp_path):
    folder = write_sharded(tmp_path / "m", shards=1)
    shard = folder / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:  # an interrupted copy: the header is whole, the last 4 KB of data are not there
        f.truncate(shard.stat().st_size - 4096)
    [problem] = problems_of(folder)
    assert str(shard) in problem and "truncated" in problem and "4,096 missing" in problem


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda p: p.write_bytes(struct.pack("<Q", 10**9) + p.read_bytes()[8:]), "header claims 1,000,000,000 bytes"),
        (lambda p: p.write_bytes(p.read_bytes()[:8] + b"{not json" + p.read_bytes()[17:]), "not valid JSON"),
        (lambda p: p.write_bytes(b"\x01\x02"), "too short"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 100), "100 bytes after the last tensor"),
        (lambda p: rewrite_header(p, lambda h: h["model.norm.weight"].update(shape=[8])), "span"),
        (lambda p: rewrite_header(p, lambda h: h["model.norm.weight"].update(dtype="Q4")), "unknown dtype 'Q4'"),
        (
            lambda p: rewrite_header(
                p,
                lambda h: h["model.norm.weight"].update(
                    data_offsets=[o + 2 for o in h["model.norm.weight"]["data_offsets"]]
                ),
            ),
            "gap of 2 bytes",
        ),
    ],
    ids=["length beyond the file", "not JSON", "too short", "trailing bytes", "span vs shape", "unknown dtype", "gap"],
)
def test_each_kind_of_damaged_header_is_a_problem_naming_the_file(tmp_path, damage, says):
    folder = write_sharded(tmp_path / "m", shards=1)
    shard = folder / "model-00001-of-00001.safetensors"
    damage(shard)
    [problem] = problems_of(folder)
    assert problem.startswith(str(shard)) and says in problem, problem


def test_the_index_names_a_missing_shard_and_a_tensor_its_shard_lacks(tmp_path):
    folder = write_sharded(tmp_path / "m")
    (folder / "model-00002-of-00002.safetensors").unlink()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = problems_of(folder)
    assert any(
        "1 of 2 shards named by model.safetensors.index.json are missing, e.g. model-00002-of-00002" in p
        for p in problems
    )
    assert any(
        "model-00001-of-00002.safetensors: lacks 1 tensors" in p and "model.layers.1.mlp.up_proj.weight" in p
        for p in problems
    )


def test_the_target_check_fails_on_a_truncated_shard_and_passes_the_tiny_target(tmp_path, tiny_target):
    good = files.target_weights(ctx_for(tmp_path, tiny_target))
    assert [r.status for r in good] == ["ok", "ok"]
    assert "embedding F32, final norm F32, lm_head F32" in good[1].detail

    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_target, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate((broken / "model.safetensors").stat().st_size - 4096)
    [bad] = files.target_weights(ctx_for(tmp_path, broken))
    assert bad.status == "fail" and "model.safetensors: truncated" in bad.detail and bad.remedy


def quantized_lm_head(header: dict) -> None:
    """What a compressed-tensors INT4 checkpoint stores for a quantized linear layer instead of `weight`."""
    entry = header.pop("lm_head.weight")
    start, end = entry["data_offsets"]
    half = (end - start) // 2
    header["lm_head.weight_packed"] = {"dtype": "I32", "shape": [half // 4], "data_offsets": [start, start + half]}
    header["lm_head.weight_scale"] = {
        "dtype": "BF16",
        "shape": [(end - start - half) // 2],
        "data_offsets": [start + half, end],
    }


def test_a_quantized_lm_head_or_embedding_fails_and_the_quantization_is_noted(tmp_path):
    config = {
        "model_type": "deepseek_v3",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 4}}},
        },
    }
    folder = write_sharded(tmp_path / "m", config=config, shards=1)
    shard = folder / "model-00001-of-00001.safetensors"
    rewrite_header(shard, quantized_lm_head)
    rewrite_header(
        shard, lambda h: h["model.embed_tokens.weight"].update(dtype="F8_E4M3", shape=[64, 32])
    )  # same bytes: 64×16 bf16 = 64×32 fp8
    result = files.dense_tensors(folder, files.read_weights(folder))
    assert result.status == "fail"
    assert "quantization: compressed-tensors (4-bit)" in result.detail
    assert "lm_head `lm_head.weight` is quantized (stored as weight_packed I32, weight_scale BF16)" in result.detail
    assert "embedding `model.embed_tokens.weight` is quantized (stored as weight F8_E4M3)" in result.detail


def test_dense_tensors_under_a_quantized_checkpoint_and_a_nested_language_model_pass(tmp_path):
    folder = write_sharded(tmp_path / "m", config={"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})
    # a multimodal checkpoint nests the language model: language_model.model.embed_tokens, language_model.lm_head
    for shard in folder.glob("*.safetensors"):
        rewrite_header(
            shard,
            lambda h: [h.__setitem__(("language_model." + k) if k != "__metadata__" else k, h.pop(k)) for k in list(h)],
        )
    index = folder / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {"language_model." + k: v for k, v in wm.items()}}))
    result = files.dense_tensors(folder, files.read_weights(folder))
    assert result.status == "ok" and "quantization: fp8 (e4m3)" in result.detail and "lm_head BF16" in result.detail


def ctx_for(tmp_path, target, stage="train", **sections):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    data = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target)},
        "data": {"prompts": str(tmp_path / "p.jsonl")},
        **sections,
    }
    return pipeline.make_context(parse_config(data, base_dir=tmp_path), stage)


def test_init_from_and_evaluate_checkpoint_files(tmp_path, tiny_target):
    drafter = write_sharded(tmp_path / "drafter", shards=1)
    ok = files.init_from_files(ctx_for(tmp_path, tiny_target, train={"init_from": str(drafter)}))
    assert ok.status == "ok"
    shard = drafter / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    bad = files.init_from_files(ctx_for(tmp_path, tiny_target, train={"init_from": str(drafter)}))
    assert bad.status == "fail" and "10 missing" in bad.detail
    bad = files.evaluate_checkpoint_files(
        ctx_for(tmp_path, tiny_target, "evaluate", evaluate={"checkpoint": str(drafter)})
    )
    assert bad.status == "fail"
    # the default checkpoint is train's: absent in a strict pre-flight, "will be produced" ahead of a first run
    ctx = ctx_for(tmp_path, tiny_target, "evaluate")
    assert files.evaluate_checkpoint_files(ctx).status == "fail"
    ctx.pending = ("train",)
    assert files.evaluate_checkpoint_files(ctx).detail == "will be produced by `train`"


def write_features(folder: Path, n_shards: int = 2, hidden: int = 8) -> None:
    entries = []
    for n in range(n_shards):
        ids, lengths = [f"s{n}a", f"s{n}b"], [3, 5]
        with sh.ShardWriter(folder / sh.shard_name(n), ids, lengths, hidden, "bfloat16") as w:
            for j, L in enumerate(lengths):
                w.write(j, sh.encode(torch.zeros(L, 3 * hidden), torch.zeros(L, hidden), "bfloat16"))
        entries.append(w.entry())
    sh.write_index(folder, entries, {"hidden_size": hidden})


def test_feature_shards_before_offline_training(tmp_path, tiny_target):
    ctx = ctx_for(tmp_path, tiny_target, extract={"mode": "offline"})
    missing = files.feature_shards(ctx)
    assert missing.status == "fail" and "index.json" in missing.detail
    ctx.pending = ("prepare", "vocab", "extract")
    assert files.feature_shards(ctx).detail == "will be produced by `extract`"
    ctx.pending = ()
    folder = ctx.run.stage_dir("extract")
    folder.mkdir(parents=True)
    write_features(folder)
    good = files.feature_shards(ctx)
    assert good.status == "ok" and "2 shards" in good.detail and "16 tokens" in good.detail
    shard = folder / sh.shard_name(1)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    bad = files.feature_shards(ctx)
    assert bad.status == "fail" and sh.shard_name(1) in bad.detail and "truncated" in bad.detail
    assert files.feature_shards(ctx_for(tmp_path, tiny_target)).status == "skip"  # online: nothing stored
