"""SGLang's own model code builds exported drafters on the CPU and loads their weights; run by
tests/drafters/test_sglang_forms.py in .venv-vllm (torch for the CPU), never imported by eaglekit.

    python sglang_probe.py SGLANG_ROOT PORT FOLDER...   (light:FOLDER: loaded whole, not key by key)

and $EAGLEKIT_SGLANG_COMMANDS, a JSON list of printed launch commands, read by SGLang's own argument parser.

SGLANG_ROOT is the sglang 0.5.23 wheel unpacked (scripts/setup.sh). For each folder, as SGLang's draft worker does:
``sglang.srt.utils.hf_transformers_utils.get_config`` reads config.json, the class named by its ``architectures``
among the ``EntryClass`` lists of ``models/dflash.py``, ``models/dspark.py``, ``models/llama_eagle3.py`` and
``models/kimi_k25_eagle3.py`` is built from it (tensor parallel 1 over gloo, as SGLang's layer tests set up), and
its ``load_weights`` is fed the checkpoint one key at a time. Every parameter starts as NaN, so what each key
filled shows, and whether its values arrived intact. Prints one JSON object: per folder, the class, the parameters
and shapes SGLang built, where each key landed (or that SGLang skipped it, or the error it raised), the parameters
left unfilled, the config keys SGLang read, and what it built from the config (block size, taps, windows, ...).

What is not SGLang's own code here: the ``sglang`` package's ``__init__`` (the server front end) does not run, and
four third-party modules the model code never calls but that modules on its import path name (orjson, IPython,
torchvision, gguf; absent from .venv-vllm) are empty stand-ins. Nothing serves: the attention kernels, the
draft worker and the CUDA graphs need a GPU.
"""

import importlib
import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
import types

import transformers  # noqa: F401  (first: its availability flags must see that torchvision is absent)
import transformers.utils.import_utils  # noqa: F401

ROOT, PORT, FOLDERS = sys.argv[1], sys.argv[2], sys.argv[3:]
STAND_INS = ("orjson", "IPython", "torchvision", "gguf")


class _Anything(types.ModuleType):
    """An absent module that modules on the import path name but the model code never calls."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything("result")

    def __mro_entries__(self, bases):
        return (object,)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "sglang":  # the package without its __init__ (the server front end)
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None if spec.name == "sglang" else _Anything(spec.name)

    def exec_module(self, module):
        module.__path__ = [os.path.join(ROOT, "sglang")] if module.__name__ == "sglang" else []


sys.path.insert(0, ROOT)
sys.meta_path.insert(0, _Finder())

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils.hf_transformers_utils import get_config  # noqa: E402

reset_context()
# device "cuda" in the published arguments: the layers take a GPU server's construction path (the CPU path of the MLA
# rotary embedding builds only deepseek_yarn); the tensors stay on the CPU
publish(ServerArgs(model_path="dummy", device="cuda"), role="test", ranks=SpawnRanks(world_rank=0))
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
initialize_model_parallel(backend="gloo")

CLASSES = {}
for module in ("dflash", "dspark", "llama_eagle3", "kimi_k25_eagle3"):
    for cls in importlib.import_module(f"sglang.srt.models.{module}").EntryClass:
        CLASSES[cls.__name__] = (module, cls)


# the targets whose aux capture the drafters rely on: Llama/Qwen3 (the tiny target is a Llama), DeepSeek-V2/V3 and
# Kimi-K2.5 (MLA; DFlash on Kimi-K2.5 is sglang#29218)
TARGETS = {}
for module, names in (
    ("llama", ("LlamaForCausalLM",)),
    ("qwen3", ("Qwen3ForCausalLM",)),
    ("deepseek_v2", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")),
    ("kimi_k25", ("KimiK25ForConditionalGeneration",)),
):
    loaded = importlib.import_module(f"sglang.srt.models.{module}")
    TARGETS |= {name: getattr(loaded, name) for name in names}


def captured(method, layer_ids):
    """The hidden states a target captures for a drafter: its own ``set_*_layers_to_capture`` run on a stand-in
    holding what the method touches (SGLang captures the input of layer i, HF's hidden_states[i])."""
    language = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace(), config=None
    )
    out = {}
    for name, cls in TARGETS.items():
        if not hasattr(cls, method):
            continue
        if name.startswith("Kimi"):  # delegates to its DeepSeek-V3 language model
            stand_in = types.SimpleNamespace(language_model=language)
            language.set_dflash_layers_to_capture = types.MethodType(
                TARGETS["DeepseekV3ForCausalLM"].set_dflash_layers_to_capture, language
            )
            language.set_eagle3_layers_to_capture = types.MethodType(
                TARGETS["DeepseekV3ForCausalLM"].set_eagle3_layers_to_capture, language
            )
        else:
            stand_in = language
        getattr(cls, method)(stand_in, list(layer_ids))
        out[name] = list(language.model.layers_to_capture)
    return out


class _ReadKeys(dict):
    """A nested config section that records the keys read from it."""

    def __init__(self, data, prefix, record):
        super().__init__(data)
        self._prefix, self._record = prefix, record

    def get(self, key, default=None):
        self._record.add(self._prefix + key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._record.add(self._prefix + key)
        return super().__getitem__(key)


def recording(cfg, record):
    """The config SGLang read, as an instance of a subclass that records each attribute read."""
    base = type(cfg)

    def __getattribute__(self, name):
        if not name.startswith("_"):
            record.add(name)
        return base.__getattribute__(self, name)

    cfg.__class__ = type(base.__name__, (base,), {"__getattribute__": __getattribute__})
    for section in ("dflash_config", "dspark_config", "eagle_config"):
        value = cfg.__dict__.get(section)
        if isinstance(value, dict):
            cfg.__dict__[section] = _ReadKeys(value, section + ".", record)
    return cfg


POSITIONS = (0, 7, 100, 255)  # where the rotary tables are compared


def rope(rotary):
    """The rotary table SGLang built: [cos | sin] rows at ``POSITIONS`` (its attention scaling folded in)."""
    cache = getattr(rotary, "cos_sin_cache", None)
    return {"class": type(rotary).__name__, "rows": None if cache is None else cache[list(POSITIONS)].tolist()}


def built(model, cfg):
    """What SGLang built from the config, as far as eaglekit's drafter depends on it."""
    out = {}
    inner = getattr(model, "model", None)
    if hasattr(model, "draft_config"):  # the DFlash family
        dc = model.draft_config
        attn = [layer.self_attn for layer in model.layers]
        out |= {
            "block_size": model.block_size,
            "num_context_features": model.num_context_features,
            "target_layer_ids": dc.target_layer_ids,
            "mask_token_id": dc.mask_token_id,
            "mask_token": dc.mask_token,
            "window_left": [a.sliding_window_size for a in attn],
            "attn_type": [a.attn_type.name for a in attn],
            "rope_base": [float(a.rotary_emb.base) for a in attn],
            "neox": [bool(a.rotary_emb.is_neox_style) for a in attn],
            "rope": rope(attn[0].rotary_emb),
            "max_position": [int(a.rotary_emb.max_position_embeddings) for a in attn],
            "heads": [a.total_num_heads for a in attn],
            "kv_heads": [a.total_num_kv_heads for a in attn],
            "head_dim": [a.head_dim for a in attn],
            "eps": [float(layer.input_layernorm.variance_epsilon) for layer in model.layers],
            "conv_taps": [c.taps for layer in model.layers for c in (layer.attention_conv, layer.mlp_conv) if c],
        }
        if model.candidate_selector is not None:
            out["selector_top_k"] = model.candidate_selector.top_k
    if hasattr(model, "markov_head"):  # DSpark
        out |= {
            "gamma": model.gamma,
            "sample_from_anchor": model.sample_from_anchor,
            "markov_head": type(model.markov_head).__name__,
            "confidence_head": model.confidence_head is not None,
        }
    if inner is not None and hasattr(inner, "fc"):  # EAGLE-3: Llama (layers) or MLA (midlayer)
        layer = inner.layers[0] if hasattr(inner, "layers") else inner.midlayer
        attn = layer.self_attn
        out |= {
            "num_aux_hidden_states": getattr(inner, "num_aux_hidden_states", None),
            "fc_in": int(inner.fc.weight.shape[1]),
            "fc_norm": getattr(inner, "fc_norm", None) is not None,
            "norm_output": bool(getattr(inner, "norm_output", False)),
            "norm_before_fc": getattr(inner, "input_norm", None) is not None,
            "draft_vocab_size": int(cfg.draft_vocab_size),
            "rope_base": float(getattr(attn.rotary_emb, "base", math.nan)),
            "neox": bool(getattr(attn.rotary_emb, "is_neox_style", True)),
            "rope": rope(attn.rotary_emb),
            "max_position": int(getattr(attn.rotary_emb, "max_position_embeddings", -1)),
            "window_left": int(getattr(getattr(attn, "attn", None), "sliding_window_size", -1) or -1),
            "eps": float(layer.input_layernorm.variance_epsilon),
        }
        eagle = getattr(cfg, "eagle_config", None) or {}
        out["eagle_aux_hidden_state_layer_ids"] = dict(eagle).get("eagle_aux_hidden_state_layer_ids")
    return out


def probe(folder, light=False):
    """``light``: the whole checkpoint loaded once, without the key-by-key accounting (the config ablations)."""
    record = set()
    cfg = recording(get_config(folder, trust_remote_code=False), record)
    arch = (cfg.architectures or [None])[0]
    if arch not in CLASSES:
        return {"error": f"no SGLang class for architectures {cfg.architectures}"}
    module, cls = CLASSES[arch]
    torch.manual_seed(0)
    model = cls(cfg)
    params = dict(model.named_parameters())
    state = load_file(os.path.join(folder, "model.safetensors"))

    def filled_by(keys):
        """The parameter elements ``load_weights`` fills from these keys, fed in one call."""
        with torch.no_grad():
            for p in params.values():
                p.fill_(math.nan)
        model.load_weights([(k, state[k]) for k in keys])
        return {n: ~torch.isnan(p) for n, p in params.items() if not torch.isnan(p).all()}

    def values(fills):
        return torch.cat([params[n].detach()[mask] for n, mask in sorted(fills.items())])

    landed, intact, errors, alone_nothing = {}, {}, {}, []
    for key, tensor in [] if light else state.items():
        try:
            fills = filled_by([key])
        except Exception as err:  # SGLang refused the key: its message names the problem
            errors[key] = f"{type(err).__name__}: {err}"
            continue
        if not fills:
            alone_nothing.append(key)
            continue
        landed[key] = sorted(fills)
        got, want = values(fills), tensor.to(values(fills).dtype).flatten()
        # a vocabulary padded by SGLang's embedding and head fills the padding rows too (zeros)
        intact[key] = torch.equal(got, want) or (
            len(fills) == 1 and torch.equal(params[landed[key][0]].detach()[: tensor.shape[0]], tensor.to(got.dtype))
        )
    # keys a loader holds until a partner arrives in the same call (the MLA drafter fuses q_a_proj with
    # kv_a_proj_with_mqa): fed together, then each left out once to see what it adds
    skipped = list(alone_nothing)
    if len(alone_nothing) > 1:
        joint = filled_by(alone_nothing)
        for key in alone_nothing:
            rest = filled_by([k for k in alone_nothing if k != key])
            adds = sorted(n for n, m in joint.items() if int(m.sum()) > int(rest.get(n, torch.zeros(())).sum()))
            if adds:
                landed[key] = adds
                skipped.remove(key)
        if joint:
            filled_by(alone_nothing)
            got = values(joint)
            want = torch.cat([state[k].to(got.dtype).flatten() for k in alone_nothing if k not in skipped])
            for key in alone_nothing:
                if key not in skipped:  # fused in SGLang's order, not the file's: compared as sorted values
                    intact[key] = torch.equal(got.sort().values, want.sort().values)
    try:
        filled_by(list(state))  # the whole checkpoint in one call, as SGLang's loader feeds it
    except Exception as err:
        errors["*"] = f"{type(err).__name__}: {err}"
    return {
        "module": f"models/{module}.py",
        "class": cls.__name__,
        "params": {n: list(p.shape) for n, p in params.items()},
        "landed": landed,
        "intact": intact,
        "skipped": skipped,
        "errors": errors,
        "unfilled": sorted(n for n, p in params.items() if torch.isnan(p).any()),
        "hot_token_id": getattr(model, "hot_token_id", None) is not None,
        "read": sorted(record),
        "built": built(model, cfg),
        "capture": capture(cfg),
    }


def capture(cfg):
    """Where each target captures this drafter's aux hidden states (the layer ids its config names)."""
    dflash = dict(getattr(cfg, "dflash_config", None) or {})
    if "target_layer_ids" in dflash or getattr(cfg, "target_layer_ids", None) is not None:
        return captured(
            "set_dflash_layers_to_capture", dflash.get("target_layer_ids", getattr(cfg, "target_layer_ids", None))
        )
    eagle = dict(getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return captured("set_eagle3_layers_to_capture", eagle) if eagle else {}


def parsed(command):
    """A printed launch command read by SGLang's own argument parser (``ServerArgs.add_cli_args``): the values of
    the flags a drafter's command sets (an unknown flag or a bad value exits the parser)."""
    import argparse
    import shlex

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = vars(parser.parse_args(argv[3:]))
    return {k: v for k, v in args.items() if k == "model_path" or (k.startswith("speculative_") and v is not None)}


results = {"commands": [parsed(c) for c in json.loads(os.environ.get("EAGLEKIT_SGLANG_COMMANDS", "[]"))]}
for arg in FOLDERS:
    folder = arg.removeprefix("light:")
    try:
        results[arg] = probe(folder, light=arg != folder)
    except Exception as err:  # the folder's build failed in SGLang's code: its message is the finding
        results[arg] = {"error": f"{type(err).__name__}: {err}"}
print("SGLANG_PROBE " + json.dumps(results))
