"""Training benchmark: one TTT step (forward + backward + AdamW step) of eaglekit vs speculators' Eagle3DraftModel.

Both sides get the same draft config (one Llama layer, H = target hidden), the same weights, sequence length,
batch and K, and each does its whole step as it ships:
  eaglekit     target logits over the draft vocab from the target's last hidden state (draft_logits: the full
               target head, then the t2d columns and the in-draft flags), then ttt_loss, backward, AdamW;
  speculators  Eagle3DraftModel.forward on the packed batch (it computes its targets itself from
               verifier_last_hidden_states through verifier_lm_head), backward, AdamW.
speculators keeps its lm_head frozen (DraftVocabMixin sets requires_grad False); eaglekit trains it, which adds
a third to its lm_head work, unless --freeze-lm-head. On CPU speculators runs with eager attention (flex
attention has no CPU backward) and eager losses (the fused ones need Triton); on CUDA with its defaults (flex
attention, torch.compile, fused losses). The batch has no prompt part unless --prompt-fraction (eaglekit skips
chains with nothing left to count; speculators computes every position at every step), and the target head is
built so its argmax lies in the draft vocab, as with a real draft vocab.

Timing interleaves the sides in one process (A B B A ...) after warmup and reports medians and the ratio:
this machine is shared and noisy, so the ratio means more than the seconds. Memory is the peak growth over one
step after a warm step has made the grads and the optimizer state: on CPU in a fresh subprocess per figure
(VmHWM, reset through /proc/self/clear_refs; every large allocation mmapped so that freed memory leaves RSS),
on CUDA torch.cuda.max_memory_allocated.

    benchmarks/.venv-speculators/bin/python benchmarks/ttt_step.py            # both sides (setup_speculators.sh)
    python benchmarks/ttt_step.py --sizes 256x512 --device cuda              # any python with eaglekit
    python benchmarks/ttt_step.py --baseline d3cd37f --eaglekit-only          # this tree vs eaglekit's TTT at a commit

eaglekit's kernels (``--variants``): "reference" (the side "eaglekit": ttt.py's own attention and loss.py's head
loss, the CPU path), "fused" (training/fused.py's kernels for the device, as train.ttt.attention / train.ttt.head_loss
auto pick them: flex attention and the compiled head loss on CUDA; on the CPU, which has no flex backward, SDPA
for step 0 and the compiled head loss, so the CPU dry run goes through the same code), "compiled" (fused, and
the drafter compiled as train.ttt.compile does). A side that fails is dropped with its error; the others go on.
``--speculators-mode`` picks speculators' own compiled path (default), the eager KL loss under its compiled
model (eager-loss), or no compilation at all (eager: dynamo disabled in this process), and the output says
which ran. ``--profile`` adds one profiled step per side, its device time grouped into attention, GEMMs, the
head loss and the rest; ``--peak-tflops`` the share of that rate the step achieves (analytical FLOPs of
benchmarks/flops.py). ``--check`` compares each eaglekit variant with the reference on this device (loss and
every gradient) instead of timing; ``--tiny`` shrinks everything so a CPU dry run takes seconds.

Without speculators it says why and prints eaglekit's figures alone. ``--baseline REF`` adds a side
"eaglekit@REF": ``src/eaglekit/training/ttt.py`` as it was at git commit REF (with this tree's drafter),
so a change to the TTT step is measured against its predecessor in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the working tree's eaglekit, installed or not
from eaglekit.config import TTTConfig  # noqa: E402
from eaglekit.drafters.eagle3.fused import REFERENCE, StepKernels, compile_drafter, compiled_chunk, step_kernels  # noqa: E402
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eaglekit.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eaglekit.model.draft_vocab import build_d2t_t2d  # noqa: E402

try:
    from eaglekit.model.target import draft_logits
except ImportError:  # target.py pulls in eaglekit.config (pydantic, yaml): a bare GPU image may lack them

    def draft_logits(hidden, lm_head_weight, t2d):
        full = hidden @ lm_head_weight.T
        return full[..., t2d].float(), t2d[full.argmax(-1)]


DECAY = 0.8
WARM_LENGTH = 64
AUX_LAYER_IDS = [2, 16, 29]


@dataclass(frozen=True)
class Shape:
    hidden: int
    seq: int
    batch: int = 1
    steps: int = 7
    vocab: int = 32000
    draft_vocab: int = 8192
    prompt_fraction: float = 0.0
    head_dim: int = 64
    gqa: int = 2  # query heads per KV head

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // self.gqa)

    @property
    def intermediate(self) -> int:
        return 3 * self.hidden

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def label(self) -> str:
        return f"H={self.hidden} L={self.seq} B={self.batch} K={self.steps}"


def drafter_config(s: Shape) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=32768,
        vocab_size=s.vocab,
        draft_vocab_size=s.draft_vocab,
        target_hidden_size=s.hidden,
        aux_layer_ids=AUX_LAYER_IDS,
    )


def make_batch(s: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random features of one batch, the draft vocab, and a target head whose argmax lies in the draft vocab."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(s.vocab, generator=g)[: s.draft_vocab].sort().values
    d2t, t2d = build_d2t_t2d(draft_ids, s.vocab)
    head = torch.randn(s.vocab, s.hidden, generator=g) * s.hidden**-0.5
    head[~t2d] *= 0.1  # a real draft vocab holds the frequent tokens: the target's argmax falls inside it
    loss_mask = torch.ones(s.batch, s.seq, dtype=torch.long)
    loss_mask[:, : int(s.prompt_fraction * s.seq)] = 0
    return dict(
        aux=torch.randn(s.batch, s.seq, 3 * s.hidden, generator=g),
        input_ids=torch.randint(s.vocab, (s.batch, s.seq), generator=g),
        last_hidden=torch.randn(s.batch, s.seq, s.hidden, generator=g),
        loss_mask=loss_mask,
        head=head,
        d2t=d2t,
        t2d=t2d,
    )


def make_drafter(s: Shape, batch: dict, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config(s))
    with torch.no_grad():
        drafter.d2t.copy_(batch["d2t"])
        drafter.t2d.copy_(batch["t2d"])
        drafter.lm_head.weight.copy_(batch["head"][batch["t2d"]])  # the target's rows, as FORMATS.md §5 suggests
    return drafter


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))


def ttt_loss_at(ref: str):
    """``ttt_loss`` of src/eaglekit/training/ttt.py as it was at git commit ``ref``."""
    repo = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "-C", str(repo), "show", f"{ref}:src/eaglekit/training/ttt.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"eaglekit-ttt-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    path = folder / f"ttt_{ref.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"ttt_at_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.ttt_loss


def variant_kernels(variant: str, device: str) -> tuple[StepKernels, bool]:
    """(kernels, compile the drafter) of an eaglekit variant: reference, fused or compiled (see the docstring); a
    ``-checkpointed`` suffix (or ``checkpointed`` alone: the reference's) recomputes each TTT step in backward
    (train.ttt.activation_checkpointing)."""
    if variant == "checkpointed" or variant.endswith("-checkpointed"):
        base = variant.removesuffix("checkpointed").removesuffix("-") or "reference"
        kernels, compile_it = variant_kernels(base, device)
        return dataclasses.replace(kernels, checkpoint_steps=True), compile_it
    if variant == "reference":
        return REFERENCE, False
    if variant not in ("fused", "compiled"):
        raise SystemExit(f"unknown eaglekit variant {variant!r}: reference, fused or compiled")
    if torch.device(device).type == "cuda":
        kernels = step_kernels("auto", "auto", torch.device(device))
    else:  # flex attention has no CPU backward: SDPA for step 0, the rest as on a GPU
        kernels = StepKernels("sdpa", compiled_chunk())
    return kernels, variant == "compiled"


def step_settings(loss_fn, steps: int) -> dict:
    """The TTT settings as ``loss_fn`` takes them: one train.ttt section now, steps and decay at an older commit
    (--baseline)."""
    if "settings" in inspect.signature(loss_fn).parameters:
        return {"settings": TTTConfig(steps=steps, decay=DECAY)}
    return {"steps": steps, "decay": DECAY}


def eaglekit_side(
    s: Shape,
    batch: dict,
    device: str,
    dtype: torch.dtype,
    freeze_lm_head: bool = False,
    loss_fn=ttt_loss,
    variant: str = "reference",
):
    """(step function, trainable parameter count). step(length) trains on the first ``length`` positions (all by
    default) and returns ttt_loss's TTTOutput."""
    kernels, compile_it = variant_kernels(variant, device)
    drafter = make_drafter(s, batch).to(device, dtype)
    if compile_it:
        compile_drafter(drafter)
    drafter.lm_head.weight.requires_grad_(not freeze_lm_head)
    opt = adamw(drafter.parameters())
    aux, ids, last, head = (
        batch[k].to(device, dtype if batch[k].is_floating_point() else None)
        for k in ("aux", "input_ids", "last_hidden", "head")
    )
    loss_mask, t2d = batch["loss_mask"].to(device), batch["t2d"].to(device)

    def step(length: int | None = None):
        with torch.no_grad():
            target_logits, in_draft = draft_logits(last[:, :length], head, t2d)
        out = loss_fn(
            drafter,
            aux[:, :length],
            ids[:, :length],
            target_logits,
            loss_mask[:, :length],
            **step_settings(loss_fn, s.steps),
            target_in_draft=in_draft,
            **({"kernels": kernels} if kernels is not REFERENCE else {}),  # --baseline's older ttt_loss lacks it
        )
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return step, sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def describe_failure(err: BaseException) -> str:
    """The error on one line, for a side's report: its type and the first line of its message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:300]


def speculators_missing() -> str | None:
    try:
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except Exception as e:  # noqa: BLE001 — any import failure means: eaglekit alone
        return f"{type(e).__name__}: {e}"
    return None


def speculators_side(s: Shape, batch: dict, device: str, dtype: torch.dtype, mode: str = "default"):
    """speculators' Eagle3DraftModel with eaglekit's drafter weights (same init), on the packed batch.

    mode: "default" (on CUDA its compiled model, flex attention and fused Triton losses), "eager-loss" (its
    eager KL loss), "eager" (also no torch.compile: dynamo is disabled for the whole process, so run it alone).
    """
    if mode == "eager":
        import torch._dynamo as dynamo

        dynamo.config.disable = True
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=1,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=32768,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    on_cpu = device == "cpu"
    layer._attn_implementation = "eager" if on_cpu else None  # None: speculators picks flex attention
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=s.draft_vocab,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=AUX_LAYER_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=s.steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in make_drafter(s, batch).state_dict().items()}
    state["verifier_lm_head.weight"] = batch["head"][batch["t2d"]]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"verifier_norm.weight"}:
        raise RuntimeError(f"speculators' Eagle3DraftModel keys differ: missing {missing}, unexpected {unexpected}")
    model.to(device, dtype)
    opt = adamw(model.parameters())
    loss_config = resolve_loss_config("kl_div", "eager" if on_cpu or mode != "default" else "fused")
    packed = dict(
        hidden_states=batch["aux"].reshape(1, s.tokens, -1).to(device, dtype),
        input_ids=batch["input_ids"].reshape(1, -1).to(device),
        document_ids=torch.arange(s.batch).repeat_interleave(s.seq)[None].to(device),
        loss_mask=batch["loss_mask"].reshape(1, -1).bool().to(device),
        verifier_last_hidden_states=batch["last_hidden"].reshape(1, s.tokens, -1).to(device, dtype),
    )

    def step(length: int | None = None):
        _, loss, _ = model(
            **{k: v[:, :length] for k, v in packed.items()},
            ttt_steps=s.steps,
            ttt_step_loss_decay=DECAY,
            loss_config=loss_config,
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_side(
    name: str, s: Shape, device: str, dtype: torch.dtype, freeze_lm_head: bool = False, speculators_mode="default"
):
    """A side by name: "eaglekit", "eaglekit+VARIANT" (fused, compiled), "eaglekit@REF" (its TTT at git commit
    REF) or "speculators"."""
    batch = make_batch(s)
    if name == "eaglekit":
        return eaglekit_side(s, batch, device, dtype, freeze_lm_head)
    if name.startswith("eaglekit+"):
        return eaglekit_side(s, batch, device, dtype, freeze_lm_head, variant=name.split("+", 1)[1])
    if name.startswith("eaglekit@"):
        return eaglekit_side(s, batch, device, dtype, freeze_lm_head, loss_fn=ttt_loss_at(name.split("@", 1)[1]))
    return speculators_side(s, batch, device, dtype, speculators_mode)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------- memory


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_peak_mib(step, device: str) -> float:
    """Peak memory growth over one call of ``step``; a warm step before it must have made grads and optimizer state."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base = _status_mib("VmRSS")
    step()
    return _status_mib("VmHWM") - base


def cpu_peak_mib(side: str, s: Shape, threads: int, freeze_lm_head: bool = False) -> float:
    """step_peak_mib of one side in a fresh subprocess, so nothing else this process allocated blurs it."""
    # Every allocation over 128 KiB gets its own mapping, returned to the OS on free: RSS then is live memory.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        side,
        "--shape-json",
        json.dumps(asdict(s)),
        "--threads",
        str(threads),
    ] + (["--freeze-lm-head"] if freeze_lm_head else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"memory subprocess for {side} {s.label()} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def memory_child(side: str, s: Shape, freeze_lm_head: bool) -> None:
    step, _ = make_side(side, s, "cpu", torch.float32, freeze_lm_head)
    step(WARM_LENGTH)  # grads and optimizer state do not depend on the length: a short warm step makes them
    print(step_peak_mib(step, "cpu"))


# ------------------------------------------------------------------------------------------------- timing


def interleaved_times(
    steps: dict, device: str, warmup: int, repeats: int, failed: dict[str, str]
) -> dict[str, list[float]]:
    """Seconds per step of each side, run A B then B A alternately so drift in machine load hits both alike.

    A side whose step raises is dropped (``steps`` and the result lose it; ``failed`` says why)."""

    def attempt(name: str) -> bool:
        try:
            steps[name]()
            return True
        except Exception as e:  # noqa: BLE001 — one side's failure (a compile error) must not cost the others
            failed[name] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"  {name} failed and is dropped: {failed[name][:400]}")
            del steps[name]
            return False

    for _ in range(warmup):
        for name in list(steps):
            attempt(name)
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            sync(device)
            t0 = time.perf_counter()
            if attempt(name):
                sync(device)
                times[name].append(time.perf_counter() - t0)
            else:
                del times[name]
    return times


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]


# ------------------------------------------------------------------------------------------------ profile

ATTENTION_KERNELS = ("flash", "fmha", "attention", "flex", "triton_tem_fused")  # triton_tem: flex's templates
GEMM_KERNELS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def profile_step(step, device: str) -> dict[str, float]:
    """Milliseconds of one step by part: attention and GEMM kernels by name, the rest; and, overlapping those,
    the head loss (everything loss.py's fused head + loss launches, its GEMMs included), plus wall time.

    On CUDA the parts are device kernel times; on the CPU self times of the aten ops (a dry run of the grouping).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    import eaglekit.drafters.eagle3.head_loss as loss_module

    head = loss_module._HeadLoss
    forward = head.forward

    def labelled(*args, **kwargs):  # the head + loss (any chunk function) inside a named range
        with record_function("eaglekit::head_loss"):
            return forward(*args, **kwargs)

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    head.forward = staticmethod(labelled)
    try:
        sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            sync(device)
            wall = time.perf_counter() - t0
    finally:
        head.forward = staticmethod(forward)
    parts = dict(attention=0.0, gemm=0.0, rest=0.0)
    head_loss = 0.0
    for e in prof.key_averages():
        if e.key == "eaglekit::head_loss":
            head_loss = max(head_loss, (e.device_time_total if cuda else e.cpu_time_total) / 1e3)
            continue
        if cuda:
            if e.device_type.name != "CUDA" and not getattr(e, "is_kernel", False):
                continue
            t = e.self_device_time_total / 1e3
        else:
            if not e.key.startswith("aten::"):
                continue
            t = e.self_cpu_time_total / 1e3
        name = e.key.lower()
        if any(k in name for k in ATTENTION_KERNELS):
            parts["attention"] += t
        elif any(k in name for k in GEMM_KERNELS):
            parts["gemm"] += t
        else:
            parts["rest"] += t
    busy = sum(parts.values())
    return dict(
        **{k: round(v, 3) for k, v in parts.items()},
        busy_ms=round(busy, 3),
        head_loss_ms=round(head_loss, 3),
        wall_ms=round(1e3 * wall, 3),
    )


# ------------------------------------------------------------------------------------------------- check


def check_variants(
    s: Shape, device: str, dtype: torch.dtype, variants: list[str], documents: int = 1
) -> dict[str, dict]:
    """Each variant against the reference on one batch: relative error of the loss and of every gradient.

    documents > 1 packs each row with that many documents of equal length (position ids restart at each)."""
    batch = make_batch(s)
    if documents > 1:
        batch["position_ids"] = (torch.arange(s.seq) % -(-s.seq // documents)).expand(s.batch, s.seq)
    results = {}
    _, want = eaglekit_grads(s, batch, device, dtype, "reference")
    for variant in variants:
        try:
            _, got = eaglekit_grads(s, batch, device, dtype, variant)
        except Exception as e:  # noqa: BLE001
            results[variant] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
            print(f"  {variant}: FAILED {results[variant]['error'][:400]}")
            continue
        errors = {name: float((got[name] - w).norm() / w.norm().clamp(min=1e-30)) for name, w in want.items()}
        worst = max(errors, key=errors.__getitem__)
        results[variant] = dict(relative_error=errors, worst=worst)
        print(f"  {variant}: loss rel. error {errors['loss']:.2e}; worst gradient {worst} {errors[worst]:.2e}")
    return results


def eaglekit_grads(s: Shape, batch: dict, device: str, dtype: torch.dtype, variant: str):
    kernels, compile_it = variant_kernels(variant, device)
    drafter = make_drafter(s, batch).to(device, dtype)
    if compile_it:
        compile_drafter(drafter)
    aux, ids, last, head = (
        batch[k].to(device, dtype if batch[k].is_floating_point() else None)
        for k in ("aux", "input_ids", "last_hidden", "head")
    )
    with torch.no_grad():
        target_logits, in_draft = draft_logits(last, head, batch["t2d"].to(device))
    out = ttt_loss(
        drafter,
        aux,
        ids,
        target_logits,
        batch["loss_mask"].to(device),
        settings=TTTConfig(steps=s.steps, decay=DECAY),
        target_in_draft=in_draft,
        position_ids=batch["position_ids"].to(device) if "position_ids" in batch else None,
        kernels=kernels,
    )
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in drafter.named_parameters() if p.grad is not None}
    return out, {"loss": out.loss.detach().float().reshape(1), **grads}


# ------------------------------------------------------------------------------------------------- run


def run(args) -> list[dict]:
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    variants = args.variants.split(",")
    sides = [] if args.speculators_only else ["eaglekit" if v == "reference" else f"eaglekit+{v}" for v in variants]
    why_not = None if args.eaglekit_only else speculators_missing()
    if not (args.eaglekit_only or why_not):
        sides.append("speculators")
    if args.baseline:
        sides.insert(1, f"eaglekit@{args.baseline}")
    if args.speculators_mode == "eager" and "speculators" in sides and len(sides) > 1:
        raise SystemExit(
            "--speculators-mode eager turns torch.compile off for the whole process: add --speculators-only"
        )
    print(
        f"torch {torch.__version__}, device {device}, dtype {str(dtype).removeprefix('torch.')}, "
        f"threads {torch.get_num_threads()}, repeats {args.repeats} (+{args.warmup} warmup)"
    )
    if why_not:
        print(f"speculators is not importable here ({why_not}): eaglekit's figures alone")
    elif "speculators" in sides:
        print(f"speculators mode: {args.speculators_mode}")
    results = []
    for hidden, seq in parse_sizes(args.sizes):
        s = Shape(
            hidden,
            seq,
            args.batch,
            args.steps,
            args.vocab,
            args.draft_vocab,
            args.prompt_fraction,
            args.head_dim,
            args.gqa,
        )
        print(
            f"\n{s.label()}  V={s.vocab} Vd={s.draft_vocab} heads={s.heads}/{s.kv_heads}x{s.head_dim} I={s.intermediate}"
        )
        if args.check:
            check = check_variants(s, device, dtype, variants, args.documents)
            results.append(dict(shape=asdict(s), label=s.label(), documents=args.documents, check=check))
            write_json(args, results)
            continue
        steps, params, failed = {}, {}, {}
        for side in sides:
            try:
                steps[side], params[side] = make_side(
                    side, s, device, dtype, args.freeze_lm_head, args.speculators_mode
                )
            except Exception as e:  # noqa: BLE001
                failed[side] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(f"  {side} could not be built: {failed[side][:400]}")
        times = interleaved_times(steps, device, args.warmup, args.repeats, failed)
        ran = list(times)
        counted = None
        for side in ran:  # every eaglekit side counts the same positions; speculators has no count_k
            if side.startswith("eaglekit"):
                counted = steps[side]().count_k
                break
        mem, prof = {}, {}
        for side in ran:
            try:
                if args.profile:
                    prof[side] = profile_step(steps[side], device)
                if not args.no_memory:
                    mem[side] = (
                        step_peak_mib(steps[side], device)
                        if device != "cpu"
                        else cpu_peak_mib(side, s, torch.get_num_threads(), args.freeze_lm_head)
                    )
            except Exception as e:  # noqa: BLE001
                print(f"  {side}: profile or memory failed: {type(e).__name__}: {str(e)[:400]}")
        del steps
        gc.collect()
        row = dict(
            shape=asdict(s),
            label=s.label(),
            params=params,
            counted_k=counted,
            median_s={k: statistics.median(v) for k, v in times.items()},
            times_s=times,
            peak_mib=mem,
            profile_ms=prof,
            failed=failed,
            speculators_mode=args.speculators_mode if "speculators" in sides else None,
        )
        row["tokens_per_s"] = {k: s.tokens / v for k, v in row["median_s"].items()}
        if counted is not None:
            from flops import step_flops  # flops.py imports this file: imported here, not at the top

            flops = sum(step_flops(s, counted, args.freeze_lm_head).values())
            row["tflop_per_step"] = flops / 1e12
            row["tflops"] = {k: flops / v / 1e12 for k, v in row["median_s"].items()}
            if args.peak_tflops:
                row["share_of_peak"] = {k: v / args.peak_tflops for k, v in row["tflops"].items()}
        results.append(row)
        print(f"  counted positions per step (eaglekit): {counted}")
        for side in ran:
            spread = f"{min(times[side]):.3f}..{max(times[side]):.3f}"
            mem_txt = f"  peak +{mem[side]:8.1f} MiB" if side in mem else ""
            rate = f"  {row['tflops'][side]:7.1f} TFLOP/s" if "tflops" in row else ""
            share = f" ({100 * row['share_of_peak'][side]:.0f} % of peak)" if "share_of_peak" in row else ""
            print(
                f"  {side:18s} {row['tokens_per_s'][side]:9.0f} tok/s  median {row['median_s'][side]:.3f} s "
                f"({spread}){mem_txt}  trainable {params[side] / 1e6:.2f} M{rate}{share}"
            )
            if side in prof:
                print(f"  {'':18s} profile (ms): {prof[side]}")
        for side in failed:
            print(f"  {side:18s} FAILED: {failed[side][:400]}")
        if "eaglekit" in ran:
            for other in ran:
                if other == "eaglekit":
                    continue
                key = "" if other == "speculators" else f"_vs_{other}"
                row["throughput_ratio" + key] = row["tokens_per_s"]["eaglekit"] / row["tokens_per_s"][other]
                line = f"  eaglekit/{other}: throughput x{row['throughput_ratio' + key]:.2f}"
                if "eaglekit" in mem and other in mem:
                    row["memory_ratio" + key] = mem["eaglekit"] / mem[other]
                    line += f", peak memory x{row['memory_ratio' + key]:.2f}"
                print(line)
        write_json(args, results)
    return results


def write_json(args, results: list[dict]) -> None:
    """The figures so far, after every size: a later size that hits its time limit keeps the earlier ones."""
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv, torch=torch.__version__, results=results), indent=1))


TINY = dict(sizes="64x96", vocab=512, draft_vocab=128, head_dim=16, gqa=2, steps=3, warmup=1, repeats=2, no_memory=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="256x512,512x2048", help="comma-separated HIDDENxSEQLEN")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=7, help="TTT steps K")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gqa", type=int, default=2, help="query heads per KV head")
    p.add_argument("--prompt-fraction", type=float, default=0.0, help="leading share of each row left out of the loss")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA unless given")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: the machine is shared)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--freeze-lm-head", action="store_true", help="freeze eaglekit's lm_head too, as speculators does")
    p.add_argument("--variants", default="reference", help="eaglekit's kernels: reference,fused,compiled")
    p.add_argument("--eaglekit-only", action="store_true")
    p.add_argument("--speculators-only", action="store_true")
    p.add_argument("--speculators-mode", choices=["default", "eager-loss", "eager"], default="default")
    p.add_argument("--baseline", help="also time eaglekit's TTT as it was at this git commit (e.g. main)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--profile", action="store_true", help="one profiled step per side, grouped by part")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense rate (H200 bf16: 790)")
    p.add_argument("--check", action="store_true", help="compare each variant with the reference, no timing")
    p.add_argument("--documents", type=int, default=1, help="--check: documents packed per row")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a dry run of every code path in seconds")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--shape-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.memory_child, Shape(**json.loads(args.shape_json)), args.freeze_lm_head)
    run(args)


if __name__ == "__main__":
    main()
