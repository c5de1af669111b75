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
attention, torch.compile, fused losses), and when that compiled path raises (its fused loss crashed under torch
2.11's dynamo) with its eager loss and attention instead, saying so. The batch has no prompt part unless --prompt-fraction (eaglekit skips
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

Without speculators it says why and prints eaglekit's figures alone. Each side is isolated: a side that fails (to
build, to step, to measure) is reported with its error and the others' figures are still printed and written. ``--baseline REF`` adds a side
"eaglekit@REF": ``src/eaglekit/training/ttt.py`` as it was at git commit REF (with this tree's drafter),
so a change to the TTT step is measured against its predecessor in the same run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
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
from eaglekit.model.drafter import DrafterConfig, Eagle3Drafter, build_d2t_t2d  # noqa: E402
from eaglekit.training.ttt import ttt_loss  # noqa: E402

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
        drafter.lm_head.weight.copy_(batch["head"][batch["t2d"]])  # the target's rows, as docs/formats.md §12 suggests
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


def eaglekit_side(
    s: Shape, batch: dict, device: str, dtype: torch.dtype, freeze_lm_head: bool = False, loss_fn=ttt_loss
):
    """(step function, trainable parameter count). step(length) trains on the first ``length`` positions (all by
    default) and returns ttt_loss's TTTOutput."""
    drafter = make_drafter(s, batch).to(device, dtype)
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
            steps=s.steps,
            decay=DECAY,
            target_in_draft=in_draft,
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


def speculators_side(s: Shape, batch: dict, device: str, dtype: torch.dtype, eager: bool):
    """speculators' Eagle3DraftModel with eaglekit's drafter weights (same init), on the packed batch; ``eager``:
    its eager attention and losses instead of flex attention, torch.compile and the fused Triton losses."""
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
    layer._attn_implementation = "eager" if eager else None  # None: speculators picks flex attention
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
    loss_config = resolve_loss_config("kl_div", "eager" if eager else "fused")
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


class EagerFallback:
    """speculators' step as it ships (compiled on CUDA); if the compiled path raises, while building or at any step,
    the side is rebuilt once from the same initial weights with speculators' eager loss and attention, and says so:
    its figures are then eager ones (``note``), and the other sides' figures are not lost to its compiler."""

    def __init__(self, s: Shape, batch: dict, device: str, dtype: torch.dtype):
        self.build = lambda eager: speculators_side(s, batch, device, dtype, eager)
        self.note: str | None = "eager loss and attention (CPU)" if device == "cpu" else None
        try:
            self.step, self.params = self.build(eager=self.note is not None)
        except Exception as e:  # noqa: BLE001 — any failure of the compiled path: try the eager one
            self.fall_back("building", e)

    def fall_back(self, what: str, err: Exception) -> None:
        self.note = f"eager loss and attention: its compiled path failed {what} ({describe_failure(err)})"
        print(f"  speculators: {self.note}", flush=True)
        self.step, self.params = self.build(eager=True)

    def __call__(self, length: int | None = None):
        if self.note is not None:
            return self.step(length)
        try:
            return self.step(length)
        except Exception as e:  # noqa: BLE001
            self.fall_back("in a step", e)
            return self.step(length)


def make_side(name: str, s: Shape, device: str, dtype: torch.dtype, freeze_lm_head: bool = False):
    """A side by name: "eaglekit", "eaglekit@REF" (its TTT at git commit REF) or "speculators"."""
    batch = make_batch(s)
    if name == "eaglekit":
        return eaglekit_side(s, batch, device, dtype, freeze_lm_head)
    if name.startswith("eaglekit@"):
        return eaglekit_side(s, batch, device, dtype, freeze_lm_head, loss_fn=ttt_loss_at(name.split("@", 1)[1]))
    side = EagerFallback(s, batch, device, dtype)
    return side, side.params


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
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"memory subprocess for {side} {s.label()} failed: {last}\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def memory_child(side: str, s: Shape, freeze_lm_head: bool) -> None:
    step, _ = make_side(side, s, "cpu", torch.float32, freeze_lm_head)
    step(WARM_LENGTH)  # grads and optimizer state do not depend on the length: a short warm step makes them
    print(step_peak_mib(step, "cpu"))


# ------------------------------------------------------------------------------------------------- timing


def interleaved_times(steps: dict, device: str, warmup: int, repeats: int, failed: dict) -> dict[str, list[float]]:
    """Seconds per step of each side, run A B then B A alternately so drift in machine load hits both alike. A side
    whose step raises leaves ``steps`` (its error in ``failed``); the others go on."""

    def timed(name: str) -> float | None:
        try:
            sync(device)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            return time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 — one side failing must not lose the others' figures
            failed[name] = f"step: {describe_failure(e)}"
            print(f"  {name}: failed ({failed[name]}); the other sides go on", flush=True)
            del steps[name]
            return None

    for _ in range(warmup):
        for name in list(steps):
            timed(name)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            seconds = timed(name)
            if seconds is not None:
                times[name].append(seconds)
    return {name: t for name, t in times.items() if name in steps}


def isolated(name: str, what: str, failed: dict, fn, *args):
    """``fn(*args)``, or None with the error recorded in ``failed[name]`` and said: the other sides go on."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 — one side failing must not lose the others' figures
        failed[name] = f"{what}: {describe_failure(e)}"
        print(f"  {name}: failed ({failed[name]}); the other sides go on", flush=True)
        return None


def counted_k(step) -> list[int]:
    """Positions eaglekit's step counts at each TTT step (one more step, its TTTOutput)."""
    return step().count_k


def side_peak_mib(side: str, step, s: Shape, device: str, freeze_lm_head: bool) -> float:
    """step_peak_mib of a side: on CUDA in this process; on CPU in a fresh subprocess (cpu_peak_mib)."""
    if device != "cpu":
        return step_peak_mib(step, device)
    return cpu_peak_mib(side, s, torch.get_num_threads(), freeze_lm_head)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]


def run(args) -> list[dict]:
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    why_not = None if args.eaglekit_only else speculators_missing()
    sides = ["eaglekit"] if args.eaglekit_only or why_not else ["eaglekit", "speculators"]
    if args.baseline:
        sides.insert(1, f"eaglekit@{args.baseline}")
    print(
        f"torch {torch.__version__}, device {device}, dtype {str(dtype).removeprefix('torch.')}, "
        f"threads {torch.get_num_threads()}, repeats {args.repeats} (+{args.warmup} warmup)"
    )
    if why_not:
        print(f"speculators is not importable here ({why_not}): eaglekit's figures alone")
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
            f"\n{s.label()}  V={s.vocab} Vd={s.draft_vocab} heads={s.heads}/{s.kv_heads}x{s.head_dim} "
            f"I={s.intermediate}",
            flush=True,
        )
        failed: dict[str, str] = {}
        steps, params = {}, {}
        for side in sides:
            built = isolated(side, "build", failed, make_side, side, s, device, dtype, args.freeze_lm_head)
            if built is not None:
                steps[side], params[side] = built
        times = interleaved_times(steps, device, args.warmup, args.repeats, failed)
        counted = isolated("eaglekit", "count", failed, counted_k, steps["eaglekit"]) if "eaglekit" in steps else None
        notes = {side: step.note for side, step in steps.items() if getattr(step, "note", None)}
        mem = {}
        if not args.no_memory:
            for side in list(steps):
                peak = isolated(
                    side, "memory", failed, side_peak_mib, side, steps[side], s, device, args.freeze_lm_head
                )
                if peak is not None:
                    mem[side] = peak
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
            failed=failed,
            notes=notes,
        )
        row["tokens_per_s"] = {k: s.tokens / v for k, v in row["median_s"].items()}
        results.append(row)
        print(f"  counted positions per step (eaglekit): {counted}")
        for side in sides:
            if side not in times:
                print(f"  {side:12s} failed: {failed.get(side, 'no figures')}")
                continue
            spread = f"{min(times[side]):.3f}..{max(times[side]):.3f}"
            mem_txt = f"  peak +{mem[side]:8.1f} MiB" if side in mem else ""
            note = f"  [{notes[side]}]" if side in notes else ""
            print(
                f"  {side:12s} {row['tokens_per_s'][side]:9.0f} tok/s  median {row['median_s'][side]:.3f} s "
                f"({spread}){mem_txt}  trainable {params[side] / 1e6:.2f} M{note}"
            )
        for other in sides[1:]:
            if "eaglekit" not in times or other not in times:
                continue  # a ratio needs both sides' figures
            key = "" if other == "speculators" else f"_vs_{other}"
            row["throughput_ratio" + key] = row["tokens_per_s"]["eaglekit"] / row["tokens_per_s"][other]
            line = f"  eaglekit/{other}: throughput x{row['throughput_ratio' + key]:.2f}"
            if "eaglekit" in mem and other in mem:
                row["memory_ratio" + key] = mem["eaglekit"] / mem[other]
                line += f", peak memory x{row['memory_ratio' + key]:.2f}"
            print(line)
    return results


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
    p.add_argument("--eaglekit-only", action="store_true")
    p.add_argument("--baseline", help="also time eaglekit's TTT as it was at this git commit (e.g. main)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--shape-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.memory_child, Shape(**json.loads(args.shape_json)), args.freeze_lm_head)
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv, torch=torch.__version__, results=results), indent=1))


if __name__ == "__main__":
    main()
