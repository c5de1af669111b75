"""The DFlash2 block drafter's own parts: an untrained one is DFlash, its convolution stays causal inside each block,
its export loaded by vLLM 0.32's own loader computes the same convolution and selector scores as eaglekit, its
selector objective, and the named fallback (verify on vLLM's CPU build, an engine that would serve it as plain
DFlash). What every block family does (training, lossless decoding, the export read back key by key, `eaglekit run`)
is tested in tests/drafters/test_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import run_in_vllm
from test_families import block_run_config
from transformers import AutoModelForCausalLM

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.objective import block_loss
from eaglekit.drafters.dflash2.checkpoint import FALLBACK, NOT_ON_CPU, save_dflash2
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter, block_convolution
from eaglekit.drafters.dflash2.proposer import DFlash2Proposer
from eaglekit.errors import EaglekitError
from eaglekit.model.target import default_aux_layers
from eaglekit.serving import engine_features as features

BLOCK = 4


def small(hf, mask_token_id: int = 0, **extra) -> DFlash2Config:
    extra = {"num_hidden_layers": 2, "block_size": BLOCK, "selector_rank": 8, "selector_top_k": 6} | extra
    return DFlash2Config.from_target_config(hf, default_aux_layers(hf.num_hidden_layers), mask_token_id, **extra)


@pytest.fixture(scope="module")
def hf(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target).config


def test_an_untrained_dflash2_drafter_drafts_as_dflash(hf):
    """Its convolutions start at the identity (speculators' init): with DFlash's weights it computes DFlash's
    logits, so the selector and the convolutions learn on top of a DFlash drafter."""
    torch.manual_seed(0)
    cfg = small(hf)
    drafter = DFlash2Drafter(cfg)
    plain = DFlashDrafter(DFlashConfig(**{k: v for k, v in cfg.to_dict().items() if k in DFlashConfig.__annotations__}))
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in plain.state_dict()})
    aux = torch.randn(1, 9, len(cfg.aux_layer_ids) * cfg.target_hidden_size)
    positions = torch.arange(9)[None]
    query = torch.tensor([[3, 0, 0, 0, 8, 0, 0, 0]])
    query_positions = torch.tensor([[9, 10, 11, 12, 9, 10, 11, 12]])
    mine = drafter(query, query_positions, drafter.context_kv(drafter.context(aux), positions))
    theirs = plain(query, query_positions, plain.context_kv(plain.context(aux), positions))
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_the_convolution_reads_only_earlier_slots_of_its_own_block():
    torch.manual_seed(0)
    x, coefficients = torch.randn(1, 8, 16), torch.randn(1, 8, 3, 16)  # two blocks of 4, three taps
    out = block_convolution(x, coefficients, 4)
    for slot in range(8):
        moved = x.clone()
        moved[0, slot] += 1.0
        changed = ((block_convolution(moved, coefficients, 4) - out).abs().sum(-1) > 0)[0].nonzero().flatten()
        block_end = (slot // 4 + 1) * 4
        assert changed.tolist() == list(range(slot, min(slot + 3, block_end))), slot


def test_the_selector_loss_joins_the_block_objective_and_trains_the_selector(hf):
    torch.manual_seed(0)
    cfg = small(hf, num_hidden_layers=1)
    drafter = DFlash2Drafter(cfg)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 24, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    argmax = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    ones = torch.ones_like(ids)

    def loss(weight: float) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        return block_loss(
            drafter, aux, argmax, ids, ones, ones, max_anchors=4, generator=generator, extra_weight=weight
        ).loss

    without, with_selector = loss(0.0), loss(1.0)
    assert with_selector > without  # the selector's cross-entropy is added
    with_selector.backward()
    assert drafter.candidate_selector.successor_codebook.grad.abs().sum() > 0
    assert drafter.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0


# vLLM's own loader and its own convolution and selector code, on the CPU: the config vLLM builds from the export,
# the DFlash2Qwen3ForCausalLM it constructs from it, every weight it loads, and what its layer-0 convolutions
# (``DFlashGroupedConv.prepare``/``finish``, whose non-CUDA path is plain torch) and ``_score_edges`` compute on the
# inputs the test gives. The CPU build refuses the architecture in its V1 runner at config time (the refusal is
# checked first, with vLLM's own message); the probe then lifts that one validation to build the model.
PROBE = """
import json, sys, torch
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs

target, draft, port, io = sys.argv[1:5]
spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}
args = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256, speculative_config=spec)
try:
    args.create_engine_config()
    refusal = None
except Exception as err:
    refusal = str(err)
VllmConfig._validate_v1_model_runner = lambda self: None
cfg = args.create_engine_config()
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM, _score_edges

with set_current_vllm_config(cfg):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:" + port, backend="gloo"
    )
    initialize_model_parallel(1, 1)
    model = DFlash2Qwen3ForCausalLM(vllm_config=cfg)
    model.load_weights(load_file(draft + "/model.safetensors").items())
    loaded = {k: v.detach().tolist() for k, v in model.named_parameters() if "conv" in k or "selector" in k}
    names = sorted(k for k, _ in model.named_parameters())
    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))  # the CPU linears' kernels
    given = torch.load(io + "/in.pt")
    conv = model.model.layers[0].attention_conv
    with torch.no_grad():
        prepared, kept = conv.prepare(given["x"])
        finished = conv.finish(given["y"], kept)
        selector = model.model.candidate_selector
        scores = _score_edges(
            selector.predecessor_codebook, selector.successor_codebook, given["candidates"], given["unary"],
            selector.hidden_projection(given["hidden"]), given["anchor"], selector.top_k,
        )
    torch.save({"prepared": prepared, "finished": finished, "scores": scores}, io + "/out.pt")
hf = cfg.speculative_config.draft_model_config.hf_config
print(json.dumps({
    "refusal": refusal,
    "method": cfg.speculative_config.method,
    "architectures": hf.architectures,
    "block": conv.block_size,
    "params": loaded,
    "names": names,
}))
"""


def test_vllm_loads_the_export_and_computes_the_same_convolution_and_selector(tmp_path, tiny_target, hf, vllm_python):
    from eaglekit.serving.engine import free_port

    torch.manual_seed(0)
    cfg = small(hf, mask_token_id=7)
    drafter = DFlash2Drafter(cfg)
    for p in drafter.parameters():  # distinct values everywhere, so a weight loaded into the wrong slot shows
        torch.nn.init.normal_(p, std=0.5)
    save_dflash2(drafter, tmp_path / "dflash2")
    exported = json.loads((tmp_path / "dflash2" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    section = exported["dflash_config"]
    assert [section[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")] == [
        2, 16, 8, 6,
    ]  # fmt: skip

    block, steps, top_k, h = 1 + 3, 3, cfg.selector_top_k, cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * block, h, generator=g), torch.randn(2 * block, h, generator=g)
    unary_full = torch.randn(2, steps, cfg.vocab_size, generator=g)
    candidates = unary_full.topk(top_k, dim=-1).indices
    hidden = torch.randn(2, steps, h, generator=g)
    anchor = torch.tensor([5, 9])
    torch.save(
        {"x": x, "y": y, "candidates": candidates, "unary": unary_full.gather(-1, candidates), "hidden": hidden,
         "anchor": anchor}, tmp_path / "in.pt",
    )  # fmt: skip
    probe = run_in_vllm(vllm_python, PROBE, tiny_target, tmp_path / "dflash2", free_port(), tmp_path, cwd=tmp_path)
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    # the CPU build refuses it by name (what verify quotes), and serves it with method dflash as DFlash2DraftModel
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in got["refusal"]
    assert got["method"] == "dflash" and got["architectures"] == ["DFlash2DraftModel"] and got["block"] == block

    ours = {k: v.detach() for k, v in drafter.state_dict().items()}
    params = {k: torch.tensor(v) for k, v in got["params"].items()}
    assert set(params) == {"model." + k for k in ours if "conv" in k or "selector" in k}
    for name, value in params.items():
        torch.testing.assert_close(value, ours[name.removeprefix("model.")], rtol=0, atol=0, msg=name)

    out = torch.load(tmp_path / "out.pt")
    conv = drafter.layers[0].attention_conv
    with torch.no_grad():
        prepared, kept = conv.prepare(x[None], block)
        finished = conv.finish(y[None], kept, block)
        torch.testing.assert_close(prepared[0], out["prepared"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(finished[0], out["finished"], rtol=1e-5, atol=1e-5)
        # every (predecessor, candidate) edge: the anchor before step 0, each of step l-1's candidates after
        previous = torch.cat([anchor[:, None, None].expand(-1, 1, top_k), candidates[:, :-1]], dim=1)
        mine = drafter.candidate_selector.scores(
            unary_full[:, :, None].expand(-1, -1, top_k, -1),
            hidden[:, :, None].expand(-1, -1, top_k, -1),
            previous,
            candidates[:, :, None].expand(-1, -1, top_k, -1),
        )
        torch.testing.assert_close(mine, out["scores"], rtol=1e-5, atol=1e-5)
        # the V2 runner's walk at T=0 (_selector_walk_kernel): step 0 reads the anchor's row, then the row of the
        # candidate it took; eaglekit's draft_path takes the same path
        for b in range(2):
            row, walk = 0, []
            for step in range(steps):
                row = int(out["scores"][b, step, row].argmax())
                walk.append(int(candidates[b, step, row]))
            assert drafter.draft_path(unary_full[b], hidden[b], int(anchor[b])) == walk


def test_verify_names_the_cpu_builds_refusal_and_export_names_the_fallback(tmp_path, tiny_target, vllm_python):
    from eaglekit.contract import StageContext
    from eaglekit.drafters.dflash2.family import DFlash2Family
    from eaglekit.rundir import RunDir
    from eaglekit.stages.verify import engine_serves_forms

    source = next((vllm_python.parent.parent / "lib").glob("python*/site-packages/vllm/config/vllm.py")).read_text()
    assert 'unsupported.append("DFlash candidate-head drafts")' in source and "degrade to DFlash1 silently" in source
    cfg = block_run_config(tmp_path, tiny_target, architecture="dflash2")
    cfg.verify.engine, cfg.verify.python = "vllm", str(vllm_python)
    check = engine_serves_forms(StageContext(cfg=cfg, run=RunDir(cfg.run_dir), stage="verify", fingerprint=""))
    assert check.status == "fail" and NOT_ON_CPU in check.detail and "GPU" in check.remedy
    warnings = DFlash2Family().export_warnings(
        DFlash2Drafter(small(AutoModelForCausalLM.from_pretrained(tiny_target).config))
    )
    assert FALLBACK in warnings and "plain DFlash" in FALLBACK


def test_an_engine_that_would_serve_it_as_plain_dflash_is_refused_by_name(vllm_python):
    """The engine-feature table's row: vLLM 0.32 refuses DFlash2 on its V1 runner (the selector runs or the engine
    does not start); a server of an older release may serve it as plain DFlash, which verify refuses to call a
    PASS of DFlash2."""
    config = {"architectures": ["DFlash2DraftModel"], "dflash_config": {"mask_token_id": 0}}
    installed = features.installed_vllm(vllm_python)
    assert features.check_forms(installed, {"dflash2": config}, "verify") == []  # 0.32's refusal is in its source
    old = features.Engine("vllm", "0.30.1", None, "http://127.0.0.1:1")
    with pytest.raises(EaglekitError) as refused:
        features.check_forms(old, {"dflash2": config}, "verify")
    assert "as plain DFlash" in refused.value.message and ">= 0.32.0" in refused.value.remedy


def test_the_proposer_without_the_selector_drafts_each_slots_argmax(hf):
    torch.manual_seed(0)
    drafter = DFlash2Drafter(small(hf)).eval()
    aux = torch.randn(7, len(drafter.config.aux_layer_ids) * drafter.config.target_hidden_size)
    walked, plain = DFlash2Proposer(drafter), DFlash2Proposer(drafter, selector=False)
    for proposer in (walked, plain):
        proposer.reset(list(range(7)), aux)
    path, _ = walked.propose(3, 0.0, None)
    argmax, _ = plain.propose(3, 0.0, None)
    logits = walked.block_logits([6] + [0] * 3)[1:]
    assert argmax == logits.argmax(-1).tolist()
    hidden = walked.block_hidden([6] + [0] * 3)[1:]
    assert path == drafter.draft_path(logits, hidden, 6)
