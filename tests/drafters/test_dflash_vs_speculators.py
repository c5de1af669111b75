"""The DFlash race's bridge (benchmarks/dflash_vs_speculators.py): a DFlash drafter saved by speculators 0.9.0 is
measured through eaglekit's DFlashDrafter, which is sound only if both compute the same drafts from the same weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglekit.drafters.dflash.checkpoint import SHARED
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError
from eaglekit.model.target import embedding_and_head

ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_PYTHON = ROOT / "benchmarks" / ".venv-speculators" / "bin" / "python"


def race_module():
    spec = importlib.util.spec_from_file_location(
        "dflash_vs_speculators", ROOT / "benchmarks" / "dflash_vs_speculators.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def speculators_form(folder: Path, drafter: DFlashDrafter) -> None:
    """What speculators' save_pretrained writes for a full-vocabulary DFlash drafter (read from a real save): its
    layer config as a diff against Qwen3's defaults (rms_norm_eps 1e-6 left out), no embedding and no head."""
    cfg = drafter.config
    folder.mkdir()
    layer = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "vocab_size": cfg.vocab_size,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }
    config = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": cfg.aux_layer_ids,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if k not in SHARED}
    save_file(state, folder / "model.safetensors")


def test_speculators_save_loads_as_the_same_drafter(tmp_path, tiny_target):
    from transformers import AutoConfig

    race = race_module()
    embed, head = embedding_and_head(str(tiny_target))
    torch.manual_seed(0)
    cfg = DFlashConfig.from_target_config(AutoConfig.from_pretrained(tiny_target), [2, 4, 5], 0, 2, 4)
    drafter = DFlashDrafter(cfg)
    drafter.take_target(embed, head)
    for norm in (drafter.layers[1].self_attn.k_norm, drafter.norm):  # per-layer weights must survive the trip
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    speculators_form(tmp_path / "final", drafter)

    loaded = race.load_speculators_drafter(tmp_path / "final", embed, head)
    assert loaded.config.rms_norm_eps == 1e-6 and not loaded.config.shared_k_norm

    aux = torch.randn(1, 9, 3 * cfg.target_hidden_size)
    queries, positions = torch.tensor([[5, 0, 0, 0]]), torch.arange(9, 13)[None]
    with torch.no_grad():
        want = drafter(queries, positions, drafter.context_kv(drafter.context(aux), torch.arange(9)[None]))
        got = loaded(queries, positions, loaded.context_kv(loaded.context(aux), torch.arange(9)[None]))
    torch.testing.assert_close(got, want)

    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if k not in SHARED}
    del state["layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "final" / "model.safetensors")
    with pytest.raises(EaglekitError, match=r"model\.safetensors.*missing key layers\.1\.self_attn\.k_norm\.weight"):
        race.load_speculators_drafter(tmp_path / "final", embed, head)


@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason="needs benchmarks/.venv-speculators")
def test_speculators_dflash_forward_is_eaglekits(tmp_path, tiny_target):
    """speculators' own DFlashDraftModel (random weights, its initialisation), saved by its save_pretrained, run
    by its own layers on a block of real target features, and by eaglekit's drafter loaded from that save."""
    script = f"""
import json, random, sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import dflash_vs_speculators as race
from eaglekit.tiny import sample_tasks
from eaglekit.tiny.build import encode

torch.manual_seed(0)
job = {{"target": {str(tiny_target)!r}, "aux": [2, 4, 5], "layers": 2, "block": 4, "mask_token_id": 0,
        "out": {str(tmp_path)!r}}}
model = race.speculators_model(job)
model.save_pretrained({str(tmp_path / "final")!r})
target = AutoModelForCausalLM.from_pretrained(job["target"]).eval()
rows = encode(AutoTokenizer.from_pretrained(job["target"]), sample_tasks(2, 0), random.Random(0))
print(json.dumps(race.forward_check(model, race.batch_features(target, job["aux"], rows), job)))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(SPECULATORS_PYTHON), "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check = json.loads(done.stdout.strip().splitlines()[-1])
    assert check["same_drafts"], check
    assert check["max_abs_logit_diff"] < 1e-4, check
