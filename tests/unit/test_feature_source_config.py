"""What the vLLM feature source and offline training read of the target without loading it: the final norm and
lm_head by name (an INT4 checkpoint's dense lm_head, or a named error when it is quantized), and the config
checks of extract.backend vllm."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from support.helpers import write_config

from eaglekit.config import TargetConfig, load_config
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.target import embedding_and_head, load_target, read_final_norm

BASE = {"run_dir": "run", "target": {"model": "model"}, "data": {"prompts": "prompts.jsonl"}}
VLLM = {"servers": ["http://h:8000/v1"], "storage_path": "hs"}


def test_vllm_backend_config_is_checked(tmp_path):
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            {**BASE, "extract": {"mode": "offline", "backend": "vllm", "dtype": "fp8", "vllm": VLLM}},
        )
    )
    assert cfg.extract.vllm.storage_path == str(tmp_path / "hs") and cfg.extract.vllm.connector == "stock"
    with pytest.raises(UsageError, match="extract.backend is 'vllm' but extract.mode is 'online'"):
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": {"backend": "vllm", "vllm": VLLM}}))
    with pytest.raises(UsageError, match="extract.vllm.servers is empty"):
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": {"mode": "offline", "backend": "vllm"}}))
    with pytest.raises(UsageError, match="extract.dtype"):
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": {"dtype": "int4"}}))


def test_stream_mode_needs_the_vllm_backend_and_a_positive_spool(tmp_path):
    stream = {"mode": "stream", "backend": "vllm", "vllm": VLLM, "stream": {"spool_gb": 2, "cache_gb": 1}}
    cfg = load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": stream}))
    assert cfg.extract.streamed and not cfg.extract.offline and not cfg.extract.online
    assert cfg.extract.stream.spool_gb == 2 and cfg.extract.stream.ahead == 4
    with pytest.raises(UsageError, match="extract.mode is 'stream' but extract.backend is 'hf'"):
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": {"mode": "stream"}}))
    with pytest.raises(UsageError, match="extract.stream.spool_gb"):
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "extract": {**stream, "stream": {"spool_gb": 0}}}))


def test_the_final_norm_read_by_name_is_the_models_own(tiny_target):
    norm = read_final_norm(TargetConfig(model=str(tiny_target)))
    model = load_target(TargetConfig(model=str(tiny_target)))
    x = torch.randn(5, 128) * 30
    torch.testing.assert_close(norm(x), model.model.norm(x), rtol=1e-6, atol=1e-6)


def checkpoint(folder, head: dict, quantization: dict | None):
    """A two-tensor stand-in for an INT4 checkpoint: the embedding, a packed layer weight, and lm_head as given."""
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "vocab_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "tie_word_embeddings": False,
    }
    if quantization:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(16, 8),
            "model.layers.0.mlp.down_proj.weight_packed": torch.zeros(8, 2, dtype=torch.int32),
            **head,
        },
        str(folder / "model.safetensors"),
    )
    return str(folder)


def test_an_int4_checkpoint_with_a_dense_lm_head_is_read(tmp_path):
    head = torch.randn(16, 8)
    path = checkpoint(
        tmp_path / "dense", {"lm_head.weight": head}, {"quant_method": "compressed-tensors", "ignore": ["lm_head"]}
    )
    embed, got = embedding_and_head(path)
    assert torch.equal(got, head) and embed.shape == (16, 8)


def test_a_quantized_lm_head_is_a_named_error(tmp_path):
    path = checkpoint(
        tmp_path / "packed",
        {"lm_head.weight_packed": torch.zeros(16, 1, dtype=torch.int32), "lm_head.weight_scale": torch.ones(16, 1)},
        {"quant_method": "compressed-tensors", "ignore": []},
    )
    with pytest.raises(EaglekitError, match="lm_head is quantized in this checkpoint .*compressed-tensors.*ignore"):
        embedding_and_head(path)
