"""Model files: every safetensors file's header checked against the file's size, a sharded index against its shards.

Only headers are read (8 bytes of length, then the JSON), never tensors, so a 119-shard 540 GB checkpoint is
checked in well under a second per shard. A truncated download, a shard cut short by a full disk or a file
overwritten mid-copy all show the same way: the tensors the header declares do not end exactly at the end
of the file. The rules are safetensors' own (``SafeTensors::deserialize``): header length within the file
and at most 100 MB, a JSON object, every tensor's span = its element count × its dtype's size, spans
contiguous from 0, and the last one ending at the file's end.

Also here: the content identities of what the later stages read (``read_identities``: the target's weights,
the prepared tokens, the vocabulary): whole-file sha256, hashed once and cached in the run directory, that the
stages record in their parameters — so a target whose weights change inside a shard, or tokens or a vocabulary replaced under the
same name, makes the stages that read them stale, and pre-flight names the file, its old and new hash.

Checked: the target's weights, a drafter to finetune (``train.init_from``) or to evaluate
(``evaluate.checkpoint``), and the feature shards ``extract`` wrote, before ``train`` reads them: their headers
and sizes, then (``feature_shard_contents``) their bytes against the sha256 extract recorded — the one check here
that reads whole files, once per shard (``data/shards.verify_contents`` caches what it read back).
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from eaglekit import rundir
from eaglekit.config import RunConfig
from eaglekit.contract import StageContext
from eaglekit.data.responses import RESPONSES
from eaglekit.data.vocab import PREPARED_TOKENS, VOCAB
from eaglekit.hub import incomplete_downloads, local_folder, model_folder
from eaglekit.preflight import CheckResult, fail, ok, skip, warn, will_be_produced
from eaglekit.progress import human_bytes

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
DENSE_DTYPES = ("F16", "BF16", "F32", "F64")
INDEX_NAMES = ("model.safetensors.index.json",)
REDOWNLOAD = "re-download or re-copy the named file (e.g. `huggingface-cli download REPO --local-dir DIR` resumes)"


class HeaderError(Exception):
    """What is wrong with one safetensors file, in words that name it."""


class Tensor(NamedTuple):  # a tuple: a checkpoint has ~10^5 of them
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    size: int
    tensors: dict[str, Tensor]
    metadata: dict

    @property
    def data_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())


def read_header(path: str | Path) -> Header:
    """The validated header of a safetensors file, or a HeaderError naming the file and the problem."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as err:
        raise HeaderError(f"{path}: cannot be read ({err.strerror or err})") from None
    return _read_header(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)  # keyed on size and mtime: a changed file is read again
def _read_header(path_str: str, size: int, _mtime_ns: int) -> Header:
    path = Path(path_str)
    if size < 8:
        raise HeaderError(f"{path}: {size} bytes, too short to hold a safetensors header")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise HeaderError(
                    f"{path}: its header claims {n:,} bytes but the file holds {size:,}: truncated, "
                    "or not a safetensors file"
                )
            if n > MAX_HEADER_BYTES:
                raise HeaderError(
                    f"{path}: a header of {n:,} bytes (safetensors allows {MAX_HEADER_BYTES:,}): not a safetensors file"
                )
            raw = f.read(n)
    except OSError as err:
        raise HeaderError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(
            f"{path}: the header is not valid JSON ({err}): the file is damaged or not safetensors"
        ) from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise HeaderError(f"{path}: __metadata__ is not an object")
    tensors = {name: _tensor(path, name, info) for name, info in header.items()}
    _check_layout(path, tensors, size - 8 - n)
    return Header(path, size, tensors, metadata)


def _tensor(path: Path, name: str, info) -> Tensor:
    try:  # the common case, fast: a checkpoint has ~10^5 tensors
        dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        numel = math.prod(shape)
        sound = (
            type(numel) is int
            and (not shape or min(shape) >= 0)
            and type(start) is int
            and type(end) is int
            and 0 <= start <= end
            and (numel * DTYPE_BITS[dtype]) == 8 * (end - start)
        )
    except (KeyError, TypeError, ValueError):
        sound = False
    if sound:
        return Tensor(dtype, tuple(shape), start, end)
    raise HeaderError(_tensor_problem(path, name, info))


def _tensor_problem(path: Path, name: str, info) -> str:
    """What exactly is wrong with a tensor entry the fast path refused."""
    if not isinstance(info, dict):
        return f"{path}: tensor {name!r} has no dtype/shape/data_offsets entry"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        return f"{path}: tensor {name!r} has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"{path}: tensor {name!r} has an invalid shape {shape!r}"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    span = offsets[1] - offsets[0]
    return (
        f"{path}: tensor {name!r} is {dtype} {shape} = {bits / 8:,.0f} bytes but its span "
        f"[{offsets[0]:,}, {offsets[1]:,}) holds {span:,}"
    )


def _check_layout(path: Path, tensors: dict[str, Tensor], data_bytes: int) -> None:
    """Spans contiguous from 0 and ending exactly at the end of the file."""
    end, previous = 0, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != end:
            where = f"after {previous!r}" if previous else "at the start of the data"
            kind = "a gap" if t.start > end else "an overlap"
            raise HeaderError(f"{path}: {kind} of {abs(t.start - end):,} bytes {where}, before {name!r}")
        end, previous = t.end, name
    if end > data_bytes:
        raise HeaderError(
            f"{path}: truncated: its tensors need {end:,} bytes of data but the file holds {data_bytes:,} "
            f"({end - data_bytes:,} missing)"
        )
    if end < data_bytes:
        raise HeaderError(
            f"{path}: {data_bytes - end:,} bytes after the last tensor ({previous!r}): "
            "the file is not what its header describes"
        )


# ------------------------------------------------------------------------------------------ checkpoints


@dataclass
class Weights:
    """What a model folder's safetensors files hold, and what is wrong with them."""

    folder: Path
    files: list[Path]
    headers: dict[str, Header]  # by file name
    problems: list[str]
    kind: str  # "sharded" | "single" | "pickle" | "none"

    @property
    def bytes(self) -> int:
        return sum(h.size for h in self.headers.values())

    def tensors(self) -> dict[str, Tensor]:
        return {name: t for h in self.headers.values() for name, t in h.tensors.items()}


def read_weights(folder: str | Path) -> Weights:
    """Every safetensors file of a model folder, validated; with an index, every shard it names holds its tensors."""
    folder = Path(folder)
    index = next((folder / n for n in INDEX_NAMES if (folder / n).is_file()), None)
    problems: list[str] = []
    if index is not None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as err:
            return Weights(folder, [], {}, [f"{index}: unreadable index ({err})"], "sharded")
        files = [folder / s for s in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            problems.append(f"{len(absent)} of {len(files)} shards named by {index.name} are missing, e.g. {absent[0]}")
        headers = _headers([f for f in files if f.is_file()], problems)
        missing: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            h = headers.get(shard)
            if h is not None and name not in h.tensors:
                missing.setdefault(shard, []).append(name)
        for shard, names in missing.items():
            problems.append(
                f"{folder / shard}: lacks {len(names)} tensors that {index.name} maps to it, e.g. {names[0]!r}"
            )
        return Weights(folder, files, headers, problems, "sharded")
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return Weights(folder, files, _headers(files, problems), problems, "single" if len(files) == 1 else "sharded")
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return Weights(folder, [], {}, [], "pickle")
    return Weights(folder, [], {}, [], "none")


def _headers(files: list[Path], problems: list[str]) -> dict[str, Header]:
    headers = {}
    for f in files:
        try:
            headers[f.name] = read_header(f)
        except HeaderError as err:
            problems.append(str(err))
    return headers


def weights_result(name: str, weights: Weights, what: str) -> CheckResult:
    """One check result for a folder's weights: a fail naming the first problems, or what was verified."""
    if weights.problems:
        more = f" (and {len(weights.problems) - 3} more problems)" if len(weights.problems) > 3 else ""
        return fail(name, "; ".join(weights.problems[:3]) + more, REDOWNLOAD)
    if weights.kind == "pickle":
        return warn(
            name,
            f"{weights.folder} holds PyTorch pickle weights (.bin/.pt): their integrity cannot be "
            "checked without loading them",
            f"prefer safetensors weights for {what}",
        )
    if weights.kind == "none":
        return fail(name, f"{weights.folder} holds no safetensors weights", f"point it at {what} folder with weights")
    n = len(weights.headers)
    tensors = sum(len(h.tensors) for h in weights.headers.values())
    return ok(
        name,
        f"{n} safetensors file{'s' if n != 1 else ''}, {tensors:,} tensors, {human_bytes(weights.bytes)}: "
        "every header matches its file's size",
    )


# ---------------------------------------------------------------------------------- content identities

SHORT_HASH = 16  # hex digits of a sha256 kept in parameters and shown in messages


def weight_files(folder: Path) -> list[Path]:
    """The target's weight files: the shards its index names (or its safetensors files), else its pickles."""
    files = read_weights(folder).files
    if files:
        return [f for f in files if f.is_file()]  # a missing shard is the 'target weights' check's to name
    return sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".pt") and p.is_file())


TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def target_identity(cfg: RunConfig) -> dict:
    """The target as a stage that runs it depends on it: each weight file's sha256 (by name; a re-quantised or
    re-downloaded shard of the same size is another target), its config and tokenizer files (cheaply: size and
    first/last MiB) and its dtype. A hub id that is not in the cache is its name."""
    folder = model_folder(cfg.target.model)
    if folder is None or not folder.is_dir():
        return {"model": cfg.target.model, "dtype": cfg.target.dtype}
    files = weight_files(folder)
    shown = f"the target's weights (hashed once; cached in {cfg.run_path / rundir.DIGEST_CACHE})"
    digests = rundir.run_digests(cfg.run_path, files, shown)
    return {
        "weights": {str(f.relative_to(folder)): digests.get(f, "missing")[:SHORT_HASH] for f in files},
        "files": {name: rundir.file_identity(folder / name) for name in TARGET_FILES if (folder / name).is_file()},
        "dtype": cfg.target.dtype,
    }


def chat_template_identity(template: str | None) -> str | dict | None:
    """``target.chat_template`` as a stage that renders with it depends on it: a template file by its content (moved
    or renamed, it is the same template; edited, another), an inline template as its text."""
    if template and not template.lstrip().startswith("{") and Path(template).is_file():
        return rundir.file_identity(template)
    return template


def tokenizer_identity(cfg: RunConfig) -> list[dict] | str:
    """The target's tokenizer files (they decide the token ids) by their content, wherever its folder is (a hub id's
    cached snapshot included); a hub id that is not in the cache is its name."""
    folder = model_folder(cfg.target.model)
    found = [folder / n for n in TOKENIZER_FILES if folder is not None and (folder / n).is_file()]
    return [rundir.file_identity(f) for f in found] or cfg.target.model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def output_identity(cfg: RunConfig, relative: str | Path) -> str | None:
    """The sha256 of a stage output another stage reads; None while it does not exist."""
    path = cfg.run_path / relative
    return (rundir.run_digests(cfg.run_path, [path], str(relative)).get(path) or "")[:SHORT_HASH] or None


def made_with(ctx: StageContext) -> dict | None:
    """The parameters the outputs in the stage's folder were made with (the ledger's start event of its marker's
    fingerprint), as the ledger holds them; None when the ledger does not say."""
    marker = ctx.run.read_marker(ctx.stage) or {}
    made = [
        s.get("params") for s, _ in ctx.run.attempts(ctx.stage) if s.get("fingerprint") == marker.get("fingerprint")
    ]
    return made[-1] if made and isinstance(made[-1], dict) else None


def changed_only(ctx: StageContext, inputs: tuple[str, ...]) -> bool:
    """The outputs in the stage's folder were made with today's parameters but for ``inputs`` (the data read from its
    upstream, read_identities' names): the stage may go on from them (``Stage.continues``) rather than replace them."""
    made = made_with(ctx)
    if made is None:
        return False
    today = json.loads(json.dumps(ctx.stage_def.params(ctx.resolved), default=str))
    return all(
        rundir.content_identity(made.get(k)) == rundir.content_identity(today.get(k))
        for k in set(made) | set(today)
        if k not in inputs
    )


# How each input read_identities records is named in messages, by its key among a stage's parameters (generate's
# local target is its `model`); the pipeline's "what changed" lines use them.
INPUT_NAMES = (
    (re.compile(r"(target|model)\.weights\.(?P<file>.+)"), "the target's weights ({file})"),
    (re.compile(r"(target|model)\.files\.(?P<file>.+)"), "the target's {file}"),
    (re.compile(r"(target|model)\.(?P<field>aux_layers|dtype)"), "`target.{field}`"),
    (re.compile(r"responses"), f"the generated responses (generate/{RESPONSES})"),
    (re.compile(r"tokens"), f"the prepared tokens ({PREPARED_TOKENS})"),
    (re.compile(r"vocab"), f"the vocabulary (vocab/{VOCAB})"),
)


def moved_inputs(recorded: object, today: object, key: str = "") -> list[str]:
    """The inputs among a stage's parameters (``today``'s, against those ``recorded`` in the ledger when it ran) whose
    content is the same and whose path is not ("prompts moved, the same content: now train-set-v1.jsonl, was
    prompts.jsonl"). Recorded and said, never stale (fingerprints leave paths out)."""
    if isinstance(recorded, dict) and isinstance(today, dict):
        if "sha" in today and "path" in today:
            same = rundir.content_identity(recorded) == rundir.content_identity(today)
            moved = same and recorded.get("path") not in (None, today["path"])
            return [f"{key} moved, the same content: now {today['path']}, was {recorded.get('path')}"] if moved else []
        return [m for k, v in today.items() for m in moved_inputs(recorded.get(k), v, f"{key}.{k}" if key else k)]
    if isinstance(recorded, list) and isinstance(today, list) and len(recorded) == len(today):
        return [m for old, new in zip(recorded, today, strict=True) for m in moved_inputs(old, new, key)]
    return []


def read_identities(cfg: RunConfig, *inputs: str) -> dict:
    """The parameters a stage records for what it reads of ``inputs``: "target" (its weights shard by shard, its
    files and dtype, and ``target.aux_layers``), "responses" (generate's), "tokens" (prepare's), "vocab" (the vocab
    stage's)."""
    out: dict = {}
    if "target" in inputs:
        out["target"] = {**target_identity(cfg), "aux_layers": cfg.target.aux_layers}
    if "responses" in inputs:
        out["responses"] = output_identity(cfg, Path("generate") / RESPONSES)
    if "tokens" in inputs:
        out["tokens"] = output_identity(cfg, PREPARED_TOKENS)
    if "vocab" in inputs:
        out["vocab"] = output_identity(cfg, Path("vocab") / VOCAB)
    return out


# ---------------------------------------------------------------------------------------- the target


def target_weights(ctx: StageContext) -> list[CheckResult]:
    """The target's weight files are whole, and the tensors the drafter copies from it are dense."""
    folder = model_folder(ctx.cfg.target.model)  # a hub id: its cached snapshot
    if folder is None or not folder.is_dir():
        return [skip("target weights", f"{folder or ctx.cfg.target.model} is not a local folder (see 'target folder')")]
    weights = read_weights(folder)
    weights.problems[:0] = incomplete_downloads(ctx.cfg.target.model)
    result = weights_result("target weights", weights, "the target")
    if result.status == "fail" or weights.kind in ("pickle", "none"):
        return [result]
    return [result, dense_tensors(folder, weights)]


def quantization_note(config: dict) -> str | None:
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method") or q.get("quantization_method") or "unknown method"
    bits = q.get("bits") or q.get("num_bits") or q.get("fmt")
    groups = q.get("config_groups")
    if not bits and isinstance(groups, dict):
        first: dict = next(iter(groups.values()), {})
        bits = ((first or {}).get("weights") or {}).get("num_bits")
    return f"{method}" + (f" ({bits}{'-bit' if isinstance(bits, int) else ''})" if bits else "")


# Companions that quantized layers store beside (or instead of) a dense ``weight``.
QUANTIZED_PARTS = re.compile(
    r"(weight_packed|weight_scale|weight_scale_inv|weight_shape|weight_zero_point|qweight|"
    r"qzeros|scales|g_idx|absmax|quant_map|SCB|weight_format)"
)


def _module(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}


def dense_tensors(folder: Path, weights: Weights) -> CheckResult:
    """The embedding, the final norm and lm_head — what the drafter copies or reads — are stored dense.

    Found by their Llama/Qwen/DeepSeek names (``…embed_tokens.``, ``…norm.`` beside it, ``…lm_head.`` one level
    up); a quantized checkpoint (INT4 experts, FP8 layers) usually keeps these three dense, and must.
    """
    name = "target dense tensors"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = quantization_note(config)
    tensors = weights.tensors()
    embed_key = min(
        (k for k in tensors if "embed_tokens." in k and re.search(r"(^|\.)embed_tokens\.", k)), key=len, default=None
    )
    if embed_key is None:
        return skip(
            name,
            "no `embed_tokens` tensor by that name (another architecture's naming): not checked"
            + (f"; quantization: {quant}" if quant else ""),
        )
    base = embed_key[: embed_key.index("embed_tokens.")]  # e.g. "model." or "language_model.model."
    parent = base.rsplit(".", 2)[0] + "." if base.count(".") >= 2 else ""
    tied = bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)))
    wanted = {"embedding": base + "embed_tokens.", "final norm": base + "norm.", "lm_head": parent + "lm_head."}
    problems, seen = [], []
    for role, prefix in wanted.items():
        parts = _module(tensors, prefix)
        if not parts:
            if role == "lm_head" and tied:
                continue
            problems.append(f"no {role} tensor `{prefix}weight`")
            continue
        weight = parts.get("weight")
        quantized = sorted(p for p in parts if QUANTIZED_PARTS.fullmatch(p.split(".")[0]) or "." in p)
        if weight is None or weight.dtype not in DENSE_DTYPES or quantized:
            stored = ", ".join(f"{p} {t.dtype}" for p, t in sorted(parts.items()))
            problems.append(f"{role} `{prefix}weight` is quantized (stored as {stored})")
        else:
            seen.append(f"{role} {weight.dtype}")
    q = f"quantization: {quant}; " if quant else ""
    if problems:
        return fail(
            name,
            q + "; ".join(problems),
            "use a checkpoint whose embedding, final norm and lm_head are dense (quantization tools keep them "
            "so when told to ignore them: e.g. `ignore: [lm_head]`), or set train.init_lm_head_from_target: false "
            "when only lm_head is quantized",
        )
    return ok(
        name,
        q + ", ".join(seen) + (" (lm_head tied to the embedding)" if tied and "lm_head" not in " ".join(seen) else ""),
    )


# --------------------------------------------------------------------------------------------- drafters


def drafter_folder_result(name: str, path: str | Path) -> CheckResult:
    path = Path(path)
    if not path.exists():
        return fail(name, f"{path} does not exist", "point it at a drafter folder (config.json + model.safetensors)")
    if path.is_file():
        path = path.parent
    return weights_result(name, read_weights(path), "a drafter")


def init_from_files(ctx: StageContext) -> CheckResult:
    """``train.init_from``: the published drafter to finetune is whole."""
    if not ctx.cfg.train.init_from:
        return skip("init_from files", "training a new drafter")
    folder = local_folder(ctx.cfg.train.init_from)  # a hub id: its cached snapshot
    if folder is None:
        return skip("init_from files", f"{ctx.cfg.train.init_from} is not downloaded (see init_from download)")
    return drafter_folder_result("init_from files", folder)


def evaluate_checkpoint_files(ctx: StageContext) -> CheckResult:
    """The drafter ``evaluate`` reads (``evaluate.checkpoint``, default train's best) is whole."""
    name = "drafter files"
    if ctx.cfg.evaluate.checkpoint:
        return drafter_folder_result(name, ctx.cfg.evaluate.checkpoint)
    return will_be_produced(ctx, name, "train") or drafter_folder_result(
        name, ctx.run.stage_dir("train") / "checkpoints" / "best"
    )


# --------------------------------------------------------------------------------------- feature shards


def feature_shards(ctx: StageContext) -> CheckResult:
    """Before offline training: every shard in extract's index is whole (header, size) — no hashing, seconds not hours."""
    name = "feature shards"
    if not ctx.cfg.extract.offline:
        return skip(name, f"{ctx.cfg.extract.mode} mode: no stored features")
    pending = will_be_produced(ctx, name, "extract")
    if pending:
        return pending
    from eaglekit.data import shards as sh  # lazy: heavy (torch: the pipeline imports this module)

    folder = ctx.run.stage_dir("extract")
    try:
        index = json.loads((folder / sh.INDEX).read_text())
        entries = index["shards"]
    except (OSError, ValueError, KeyError) as err:
        return fail(
            name,
            f"{folder / sh.INDEX} is missing or unreadable ({err})",
            f"run extraction: `{ctx.command_to_reach('extract')}`",
        )
    problems = []
    for entry in entries:
        path = folder / entry["file"]
        try:
            h = read_header(path)
        except HeaderError as err:
            problems.append(str(err))
            continue
        if h.size != entry.get("bytes"):
            problems.append(f"{path}: {h.size:,} bytes, the index says {entry.get('bytes'):,}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return fail(name, "; ".join(problems[:3]) + more, sh.REMEDY)
    total = sum(e.get("bytes", 0) for e in entries)
    return ok(
        name,
        f"{len(entries)} shards, {human_bytes(total)}, {index.get('tokens', '?')} tokens: headers and sizes "
        "match the index",
    )


def feature_shard_contents(ctx: StageContext) -> CheckResult:
    """Before offline training: every shard's bytes hash to the sha256 its sidecar recorded when extract wrote it
    (a bit flipped on disk or in a copy keeps the size). Hashed once; a rerun rehashes only changed shards."""
    name = "feature shard contents"
    if not ctx.cfg.extract.offline:
        return skip(name, f"{ctx.cfg.extract.mode} mode: no stored features")
    pending = will_be_produced(ctx, name, "extract")
    if pending:
        return pending
    from eaglekit.data import shards as sh  # lazy: heavy (torch: the pipeline imports this module)

    folder = ctx.run.stage_dir("extract")
    try:
        entries = json.loads((folder / sh.INDEX).read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return skip(name, f"no readable {sh.INDEX} (see 'feature shards')")
    sized = [
        e["file"]
        for e in entries
        if (folder / e["file"]).is_file() and (folder / e["file"]).stat().st_size == e.get("bytes")
    ]
    if len(sized) < len(entries):
        return skip(
            name, f"{len(entries) - len(sized)} shards are missing or not their recorded size (see 'feature shards')"
        )
    mismatches, hashed = sh.verify_contents(folder, sized)
    if mismatches:
        more = f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
        return fail(
            name,
            f"{len(mismatches)} of {len(entries)} shards in {folder} differ from what extract wrote: "
            + "; ".join(str(m) for m in mismatches[:3])
            + more,
            f"`eaglekit run CONFIG --from extract`: extract sees the mismatch and re-extracts only "
            f"{'that shard' if len(mismatches) == 1 else 'those shards'} (the others are kept), then the stages "
            "after it go on",
        )
    total = sum(e.get("bytes", 0) for e in entries)
    now = (
        f"{human_bytes(hashed)} hashed now, the rest unchanged since read back" if hashed < total else "all hashed now"
    )
    return ok(name, f"{len(entries)} shards, {human_bytes(total)}: sha256 matches each sidecar ({now})")
