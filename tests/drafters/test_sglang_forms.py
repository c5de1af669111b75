"""The folders export writes for SGLang, read by SGLang's own model code: DFlash, DFlash2 and DSpark (the block
drafters' one folder, which vLLM serves too) and EAGLE-3's plain form (a Llama layer and an MLA layer).

SGLang 0.5.23's wheel, unpacked by scripts/setup.sh --vllm into the cache, runs in .venv-vllm (torch for the CPU):
tests/support/sglang_probe.py builds the class each folder's config.json names with SGLang's own config reader and
feeds its ``load_weights`` the checkpoint key by key (module docstring there: what is not SGLang's own code). Nothing
is served: SGLang's kernels need a GPU, so no served acceptance is measured here.

What is held: SGLang loads every weight intact into the parameter eaglekit's restatement
(``drafters/{dflash,eagle3}/sglang_form.py``) names, fills every parameter, and builds from config.json the drafter
eaglekit trained (block size, target layers, mask token, window, Markov head, selector, flags); the targets' own
capture code (Llama, Qwen3, DeepSeek-V2/V3, Kimi-K2.5) takes the layers eaglekit trained on; every config key whose
removal changes what SGLang builds is one the export check requires, and its removal is refused by name; a renamed
weight, which SGLang skips without a word, is refused by name; the printed commands parse with SGLang's own flags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoints import make_drafter
from transformers import DeepseekV3Config

from eaglekit.config import parse_config
from eaglekit.drafters.dflash import sglang_form as block_form
from eaglekit.drafters.dflash.checkpoint import save_dflash
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash2.checkpoint import save_dflash2
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter
from eaglekit.drafters.dspark.checkpoint import save_dspark
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3 import sglang_form as eagle3_form
from eaglekit.drafters.eagle3.family import serve_commands
from eaglekit.drafters.registry import FAMILIES
from eaglekit.drafters.sglang_form import SGLANG_READ, read_folder
from eaglekit.errors import EaglekitError
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.layers import rope_inv_freq
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import embedding_and_head
from eaglekit.serving.engine import cpu_environment, free_port
from eaglekit.tiny.build import cache_root

pytestmark = pytest.mark.slow  # one SGLang import (~10 s of CPU) and ~260 tiny drafters built by it (~20 s CPU in all)

AUX = [2, 3, 4]  # HF hidden_states indices the block drafters tap
K = 3  # the speculative tokens the printed commands ask for
TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
BLOCK = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
    vocab_size=100, target_hidden_size=32, aux_layer_ids=AUX, block_size=4, mask_token_id=5,
)  # fmt: skip


# the target's RoPE scaling, which the drafter trains with (Llama-3.1's; the YaRN of Qwen and Kimi targets)
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
POSITIONS = (0, 7, 100, 255)  # the probe's rows of the rotary table


def block_drafter(cls, cfg):
    torch.manual_seed(0)
    drafter = cls(cfg)
    for p in drafter.parameters():  # distinct values everywhere: a weight in the wrong slot shows
        torch.nn.init.normal_(p)
    return drafter


def write_forms(root: Path) -> dict[str, tuple[Path, object]]:
    """Each form's folder as the families' writers (the ones export calls) write it, and its drafter config."""
    forms = {
        "dflash": (save_dflash, block_drafter(DFlashDrafter, DFlashConfig(**BLOCK))),
        "dflash-window": (save_dflash, block_drafter(DFlashDrafter, DFlashConfig(**BLOCK, sliding_window=8))),
        "dflash-llama3": (
            save_dflash,
            block_drafter(DFlashDrafter, DFlashConfig(**(BLOCK | {"rope_scaling": LLAMA3}))),
        ),
        "dflash-yarn": (save_dflash, block_drafter(DFlashDrafter, DFlashConfig(**(BLOCK | {"rope_scaling": YARN})))),
        "dflash2": (
            save_dflash2,
            block_drafter(
                DFlash2Drafter,
                DFlash2Config(**BLOCK, conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4),
            ),
        ),
        "dspark": (save_dspark, block_drafter(DSparkDrafter, DSparkConfig(**BLOCK, markov_rank=8))),
    }
    out = {}
    for name, (save, drafter) in forms.items():
        save(drafter, root / name)
        out[name] = (root / name, drafter.config)
    for name, drafter in (
        ("eagle3", make_drafter(fc_norm=True, norm_output=True)),
        ("eagle3-2layers", make_drafter(num_layers=2)),
        # SGLang 0.5.23's Llama drafter reads norm_before_fc (sglang#32334): export prints its SGLang command
        ("eagle3-norm-before-fc", make_drafter(norm_before_fc=True)),
        ("eagle3-mla", make_drafter(architecture="mla", fc_norm=True)),
    ):
        eagle3_checkpoint.save_legacy(drafter, root / name)
        out[name] = (root / name, drafter.config)
    return out


def without(folder: Path, dest: Path, key: str) -> Path:
    """A copy of ``folder`` whose config.json lacks ``key`` ("section.key" for a nested one)."""
    dest.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_file() and path.name != "config.json":
            os.link(path, dest / path.name)
    config = json.loads((folder / "config.json").read_text())
    section, _, name = key.rpartition(".")
    del (config[section] if section else config)[name]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def config_keys(config: dict) -> list[str]:
    return [
        f"{k}.{n}" if isinstance(v, dict) else k
        for k, v in config.items()
        for n in (v if isinstance(v, dict) else [None])
    ]


def form_module(config: dict):
    return block_form if config["architectures"][0] in block_form.ALGORITHMS else eagle3_form


@pytest.fixture(scope="session")
def sglang_root() -> Path:
    root = cache_root() / f"sglang-{SGLANG_READ}"
    if not (root / ".unpacked").is_file():
        pytest.skip(f"the sglang {SGLANG_READ} wheel is not unpacked in {root}: `bash scripts/setup.sh --vllm` does it")
    return root


@pytest.fixture(scope="module")
def probed(tmp_path_factory, sglang_root, vllm_python):
    """Every form, each config key's ablation, a renamed weight and a target hidden size SGLang cannot take, read by
    SGLang in one process: the folders, SGLang's results by folder and its parse of each printed command."""
    root = tmp_path_factory.mktemp("sglang-forms")
    forms = write_forms(root)
    ablations = {
        (name, key): without(folder, root / "without" / name / key, key)
        for name, (folder, _) in forms.items()
        for key in config_keys(json.loads((folder / "config.json").read_text()))
    }
    renamed = {}
    for name, (folder, _) in forms.items():
        dest = renamed[name] = root / "renamed" / name
        shutil.copytree(folder, dest)
        state = load_file(str(dest / "model.safetensors"))
        key = next(k for k in state if "mlp.down_proj" in k)
        state[key.replace("down_proj", "down")] = state.pop(key)
        save_file(state, str(dest / "model.safetensors"))
    wide = root / "dflash-wide-target"
    save_dflash(block_drafter(DFlashDrafter, DFlashConfig(**(BLOCK | {"target_hidden_size": 48}))), wide)
    commands = {
        name: (
            block_form.serve_command("org/target", folder, read_folder(folder)[0], K)
            if name.startswith(("dflash", "dspark"))
            else eagle3_launch(folder)
        )
        for name, (folder, _) in forms.items()
    }
    args = [str(f) for f, _ in forms.values()] + [f"light:{f}" for f in ablations.values()]
    args += [f"light:{f}" for f, _ in forms.values()] + [str(f) for f in renamed.values()] + [f"light:{wide}"]
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "EAGLEKIT_SGLANG_COMMANDS": json.dumps(list(commands.values())),
        **cpu_environment(vllm_python),
    }
    probe = subprocess.run(
        [str(vllm_python), str(Path(__file__).parents[1] / "support" / "sglang_probe.py"), str(sglang_root)]
        + [str(free_port())]
        + args,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=root,
    )
    line = next((x for x in probe.stdout.splitlines() if x.startswith("SGLANG_PROBE ")), None)
    assert probe.returncode == 0 and line, probe.stderr[-4000:]
    results = json.loads(line.removeprefix("SGLANG_PROBE "))
    parsed = dict(zip(commands, results.pop("commands"), strict=True))
    return SimpleNamespace(forms=forms, ablations=ablations, renamed=renamed, wide=wide, results=results, parsed=parsed)


def eagle3_launch(folder: Path) -> str:
    """EAGLE-3's printed SGLang command (drafters/eagle3/family.serve_commands, its plain form)."""
    cfg = SimpleNamespace(export=SimpleNamespace(num_speculative_tokens=K, verifier="org/target"), target=None)
    return next(c for what, c in serve_commands(cfg, {"eagle3": folder}) if what.startswith("SGLang"))


FORMS = (
    "dflash", "dflash-window", "dflash-llama3", "dflash-yarn", "dflash2", "dspark",
    "eagle3", "eagle3-2layers", "eagle3-norm-before-fc", "eagle3-mla",
)  # fmt: skip


@pytest.mark.parametrize("name", FORMS)
def test_sglang_loads_every_exported_weight_intact_where_eaglekit_says(probed, name):
    folder, _ = probed.forms[name]
    got = probed.results[str(folder)]
    assert "error" not in got, got.get("error")
    config, shapes = read_folder(folder)
    module = form_module(config)
    assert got["class"] == config["architectures"][0]
    assert module.problems(config, shapes) == []  # export's own check passes the folder SGLang accepts
    assert got["errors"] == {} and got["unfilled"] == []
    assert set(got["skipped"]) <= {"d2t", "t2d"} and got["hot_token_id"] == ("d2t" in shapes)  # its hot-token map
    assert got["landed"] and all(got["intact"][key] for key in got["landed"])
    restated = module.sglang_parameters(config)
    landing = (
        block_form.sglang_parameter
        if module is block_form
        else eagle3_form.landing(config["architectures"][0], restated)
    )
    for key, params in got["landed"].items():
        assert params == [landing(key)], key
    for param, shape in got["params"].items():  # SGLang pads its vocabulary tables to a multiple of 64
        want = restated[param]
        padded = param.endswith(("embed_tokens.weight", "lm_head.weight"))
        assert shape == list(want) or (padded and shape[1:] == list(want[1:]) and shape[0] >= want[0]), param
    assert set(got["params"]) == set(restated)


@pytest.mark.parametrize("name", FORMS)
def test_sglang_builds_the_drafter_eaglekit_trained(probed, name):
    folder, cfg = probed.forms[name]
    built, capture = probed.results[str(folder)]["built"], probed.results[str(folder)]["capture"]
    aux = cfg.aux_layer_ids
    # the targets' own capture code takes the hidden states the drafter was trained on (HF indices)
    assert {t: capture[t] for t in TARGETS} == {t: aux for t in TARGETS}
    assert capture["KimiK25ForConditionalGeneration"] == aux  # sglang#29218's target
    if built["rope"]["rows"] is not None and getattr(cfg, "architecture", "") != "mla":  # the trained rotary table
        inv_freq, scale = rope_inv_freq(cfg)
        angles = torch.tensor(POSITIONS, dtype=torch.float64)[:, None] * inv_freq
        want = torch.cat([angles.cos(), angles.sin()], dim=-1) * scale
        torch.testing.assert_close(torch.tensor(built["rope"]["rows"], dtype=torch.float64), want, rtol=1e-5, atol=1e-5)
    if name.startswith("eagle3"):
        assert built["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]
        assert (built["num_aux_hidden_states"], built["fc_in"]) == (3, 3 * cfg.target_hidden_size)
        assert (built["fc_norm"], built["norm_output"], built["norm_before_fc"]) == (
            cfg.fc_norm, cfg.norm_output, cfg.norm_before_fc
        )  # fmt: skip
        assert built["draft_vocab_size"] == cfg.draft_vocab_size
        assert (built["rope_base"], built["max_position"]) == (cfg.rope_theta, cfg.max_position_embeddings)
        assert built["eps"] == cfg.rms_norm_eps
        return
    layers = cfg.num_hidden_layers
    assert (built["block_size"], built["num_context_features"]) == (cfg.block_size, len(aux))
    assert built["target_layer_ids"] == [i - 1 for i in aux] and built["mask_token_id"] == cfg.mask_token_id
    assert (
        built["heads"] == [cfg.num_attention_heads] * layers and built["kv_heads"] == [cfg.num_key_value_heads] * layers
    )
    assert built["head_dim"] == [cfg.head_dim] * layers and built["eps"] == [cfg.rms_norm_eps] * layers
    assert built["rope_base"] == [cfg.rope_theta] * layers
    if not cfg.rope_scaling:  # a scaled table's own max_position is the original one (its rows are checked above)
        assert built["max_position"] == [cfg.max_position_embeddings] * layers
    if cfg.sliding_window:  # SGLang keeps window - 1 keys left of the query, causally: eaglekit's window
        assert built["window_left"] == [cfg.sliding_window - 1] * layers
        assert built["attn_type"] == ["DECODER"] * layers
    else:
        assert built["window_left"] == [-1] * layers and built["attn_type"] == ["ENCODER_ONLY"] * layers
    if name == "dflash2":
        assert built["conv_taps"] == [cfg.conv_kernel_size] * 2 * layers
        assert built["selector_top_k"] == cfg.selector_top_k
    if name == "dspark":  # anchor sampling: a block of B queries drafts B tokens; no confidence head in static mode
        assert (built["gamma"], built["sample_from_anchor"]) == (cfg.block_size, True)
        assert (built["markov_head"], built["confidence_head"]) == ("VanillaMarkov", False)


def signature(result: dict) -> str:
    """What SGLang made of a folder: its parameters, what it loaded, built and captured, or its error."""
    return json.dumps({k: result.get(k) for k in ("error", "params", "errors", "unfilled", "built", "capture")})


@pytest.mark.parametrize("name", FORMS)
def test_every_config_key_sglang_depends_on_is_required_and_refused_by_name(probed, name):
    folder, _ = probed.forms[name]
    config, shapes = read_folder(folder)
    module = form_module(config)
    base = signature(probed.results[f"light:{folder}"])
    ablations = {key: f for (form, key), f in probed.ablations.items() if form == name}
    depends = sorted(key for key, f in ablations.items() if signature(probed.results[f"light:{f}"]) != base)
    assert depends, "SGLang read nothing of config.json?"
    beside = block_form.trained(folder) if module is block_form else shapes  # what else says what was written
    required = module.required_keys(config, beside)
    assert set(depends) <= set(required), "keys SGLang depends on that the export check lets go"
    for key in required:
        if key == "norm_output":  # no weight of its own: without the key eaglekit reads the folder so too
            continue
        lacking = read_folder(ablations[key])[0]
        found = module.problems(lacking, shapes, *([beside] if module is block_form else []))
        assert f"config.json lacks {key}" in found, key
    with pytest.raises(EaglekitError, match=f"lacks {depends[0]}"):
        module.check_folder(ablations[depends[0]])


@pytest.mark.parametrize("name", FORMS)
def test_a_renamed_weight_sglang_would_skip_is_refused_by_name(probed, name):
    folder = probed.renamed[name]
    got = probed.results[str(folder)]
    key = next(k for k in read_folder(folder)[1] if ".mlp.down." in k)
    assert key in got["skipped"] and any("down_proj" in p for p in got["unfilled"])  # SGLang: no error, no weight
    module = form_module(read_folder(folder)[0])
    with pytest.raises(EaglekitError, match=f"weight {key.replace('.', '[.]')} has no SGLang parameter"):
        module.check_folder(folder)


def test_a_draft_narrower_than_its_target_gets_no_sglang_command(probed):
    """SGLang's DFlash fc is hidden_size wide per target layer: a drafter trained on a wider target cannot load."""
    assert "fc.weight shape mismatch" in probed.results[f"light:{probed.wide}"]["errors"]["*"]
    problem = block_form.export_check(probed.wide, {})
    assert problem and "target_hidden_size 48 differs from hidden_size 32" in problem


def test_the_printed_commands_parse_with_sglangs_own_flags(probed):
    for name, args in probed.parsed.items():
        folder, _ = probed.forms[name]
        assert args["model_path"] == "org/target" and args["speculative_draft_model_path"] == str(folder.resolve())
        if name.startswith("eagle3"):
            assert args["speculative_algorithm"] == "EAGLE3"
            assert (args["speculative_num_steps"], args["speculative_eagle_topk"]) == (K, 1)
            assert args["speculative_num_draft_tokens"] == K + 1
        elif name == "dspark":  # gamma = K drafts, verified with the anchor as K + 1
            assert (args["speculative_algorithm"], args["speculative_dspark_block_size"]) == ("DSPARK", K)
        else:  # the verify block: the verified token and K drafts
            assert (args["speculative_algorithm"], args["speculative_num_draft_tokens"]) == ("DFLASH", K + 1)


def test_a_tokenizer_whose_mask_token_is_another_id_gets_no_sglang_command(probed):
    """SGLang's DFLASH worker refuses a mask_token_id that the tokenizer's <|MASK|> contradicts."""
    folder, cfg = probed.forms["dflash"]
    assert block_form.export_check(folder, {"<|MASK|>": cfg.mask_token_id}) is None
    problem = block_form.export_check(folder, {"<|MASK|>": cfg.mask_token_id + 1})
    assert problem and "_resolve_mask_token_id" in problem


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_export_prints_the_sglang_command_and_for_an_mla_target_only_it(tmp_path, tiny_target, family):
    """The family's export (``engine.write``): on a Llama target both engines' commands; on a target with
    multi-head latent attention (DeepSeek-V3/Kimi) vLLM's is withheld by name (z-lab/dflash#62) and SGLang's, whose
    MLA targets capture the trained layers (above), is the one printed."""
    draft = {"architecture": family, "num_layers": 2, "block_size": 4}
    data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "p.jsonl"}}
    cfg = parse_config(data | {"train": {"draft": draft}}, base_dir=tmp_path)
    engine = FAMILIES[family].engine
    hf, aux = target_and_aux(cfg)
    drafter = FAMILIES[family].drafter_class(FAMILIES[family].sizing.drafter_config(cfg, hf, aux))
    drafter.take_target(*embedding_and_head(str(tiny_target)))
    info = CheckpointInfo(family, tmp_path, missing_embeddings=False, aux_layer_ids=aux)
    written = {}
    for name, target_hf in (("llama", hf), ("mla", DeepseekV3Config(kv_lora_rank=32))):
        ctx = SimpleNamespace(cfg=cfg, dir=tmp_path / name)
        written[name] = engine.write(ctx, lambda c, target_hf=target_hf: (drafter, info, target_hf, aux), [])
    algorithm = "DSPARK" if family == "dspark" else "DFLASH"
    llama, mla = written["llama"], written["mla"]
    assert [what.split(" ")[0] for what, _ in llama.commands] == ["vLLM", "SGLang"]
    assert f"--speculative-algorithm {algorithm}" in llama.commands[1][1]
    assert not any(w.startswith("no SGLang command") for w in llama.warnings)
    assert [what.split(" ")[0] for what, _ in mla.commands] == ["SGLang"]
    assert any(w.startswith("no vLLM command") and "z-lab/dflash#62" in w for w in mla.warnings)
    assert "SGLang" in mla.holds[engine.forms[0]] and "vLLM" not in mla.holds[engine.forms[0]]
