"""The races' bridges for DSpark, DFlash2 and P-EAGLE (benchmarks/{dspark,dflash2,peagle}_vs_speculators.py): a
drafter saved by speculators 0.9.0 is measured through eaglekit's drafter of its family, which is sound only if both
compute the same drafts from the same weights. speculators' own model of each family (random weights, its
initialisation), saved by its save_pretrained, is run by its own modules on real target features and by eaglekit's
drafter read from that save."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_PYTHON = ROOT / "benchmarks" / ".venv-speculators" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason="needs benchmarks/.venv-speculators")
def test_speculators_forward_is_eaglekits_in_every_family(tmp_path, tiny_target):
    script = f"""
import json, random, sys
sys.path[:0] = [{str(ROOT / "benchmarks")!r}, {str(ROOT / "src")!r}]
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import dflash2_vs_speculators, dspark_vs_speculators, peagle_vs_speculators
from race_common import batch_features
from eaglekit.tiny import sample_tasks
from eaglekit.tiny.build import encode

target = AutoModelForCausalLM.from_pretrained({str(tiny_target)!r}).eval()
rows = encode(AutoTokenizer.from_pretrained({str(tiny_target)!r}), sample_tasks(2, 0), random.Random(0))
batch = batch_features(target, [2, 4, 5], rows)
base = {{"target": {str(tiny_target)!r}, "aux": [2, 4, 5], "mask_token_id": 0}}
jobs = {{
    "dspark": (dspark_vs_speculators, {{"layers": 2, "block": 4, "markov_rank": 16}}),
    "dflash2": (dflash2_vs_speculators, {{"layers": 2, "block": 4, "selector_rank": 16}}),
    "peagle": (peagle_vs_speculators, {{"depths": 3}}),
}}
checks = {{}}
for name, (race, own) in jobs.items():
    torch.manual_seed(0)
    job = base | own | {{"out": {str(tmp_path)!r} + "/" + name}}
    model = race.speculators_model(job)
    model.save_pretrained(job["out"] + "/final")
    checks[name] = race.forward_check(model, batch, job)
print(json.dumps(checks))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(SPECULATORS_PYTHON), "-c", script], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(checks) == {"dspark", "dflash2", "peagle"}
    for family, check in checks.items():
        assert check["same_drafts"], (family, check)
        assert check["max_abs_logit_diff"] < 1e-4, (family, check)
