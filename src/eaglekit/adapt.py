"""``eaglekit adapt``: the served drafter finetuned on the traffic it serves, promoted only when it is better.

Steps, each recorded in the adapt run's ledger (``{"event": "adapt", "step": ...}``):

1. **finetune**: an adapt run directory is written beside the served run: the served run's config with
   ``data.traffic`` (the gateway's log, the newest ``samples`` conversations) instead of its prompts and
   ``train.init_from`` the drafter folder the engine serves; the pipeline runs it through ``export``
   (``generate`` copies the traffic, no target is asked).
2. **compare**: both drafters decode the held-out split of that traffic offline with the target (eaglekit's own
   decoding, counted as vLLM counts, at the served K). A request's drafts accept together, so the prompts are the
   units: the difference in τ gets a paired interval (the ratio estimator linearised per prompt, Student's t on
   prompts - 1 degrees of freedom). The candidate is promoted only when the whole interval lies above zero and the
   gain is at least ``min_gain``; otherwise refused, and nothing served changes.
3. **verify**: the run's own ``verify`` stage serves the candidate in the engine at the served K.
4. **swap**: where the engine can load draft weights while serving (vLLM's runtime draft weight update,
   ``LiveDraftUpdate``), the candidate's weights go to the running server; otherwise a second server is started
   with the candidate and the traffic switched to it: eaglekit's own servers behind one gateway (``ServerPool``),
   or, for the user's own servers, the commands printed (``PrintedSwitch``) and ``--confirm`` run after the switch.
5. **confirm**: ``watch``'s windows on the server that now serves the candidate, against the candidate's own
   verify figures: a window below the band rolls back (the previous drafter serves again) and says so.

A step that fails leaves the current drafter serving: nothing is switched before the candidate is verified and
ready, and a failed swap or confirmation switches back.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

from eaglekit import atomic, pipeline, watch
from eaglekit.config import RunConfig, load_config
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.rundir import RunDir
from eaglekit.serving.engine import VllmServer, is_cpu_build
from eaglekit.serving.engine_settings import from_server
from eaglekit.serving.speculation import root_of

Z_PROMOTE = 1.96  # the paired interval's half-width in standard errors: 95 %, two-sided
MIN_GAIN = 0.02  # the least relative τ gain worth a swap (a smaller one is not worth a restart's risk)
SAMPLES = 200  # the newest conversations the finetune reads
HELDOUT = 0.25  # the share of them held out for the comparison (by id, as every stage splits)
STEPS = 240  # on the tiny target's shift: 5.8 % above a drafter trained from scratch on more of the traffic
LR = 1e-3
CONFIRM_WINDOWS = 2
WINDOW_REQUESTS = 8
CONFIRM_TIMEOUT_S = 1800.0


def say_nothing(text: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------- the adapt run


def record(adapt_dir: Path, step: str, **facts: Any) -> None:
    RunDir(adapt_dir).append_event({"event": "adapt", "step": step, **facts})


def steps_recorded(adapt_dir: Path) -> list[dict]:
    return [e for e in RunDir(adapt_dir).events() if e.get("event") == "adapt"]


def served_form(folder: Path) -> str:
    """The export form of a served drafter folder (``export/eagle3`` -> ``eagle3``)."""
    return folder.name if folder.parent.name == "export" else "eagle3"


def served_config(served_run: Path) -> RunConfig:
    """The config of the run whose drafter the engine serves."""
    source = served_run / "config.yaml"
    if not source.exists():
        raise UsageError(
            f"{served_run} holds no config.yaml: it is not an eaglekit run directory",
            "pass the run directory whose drafter the engine serves (the one `eaglekit export` wrote it in)",
        )
    return load_config(source)


def traffic_run(served: RunConfig, run_dir: Path, traffic: Path, k: int, newest: int | None) -> dict:
    """The served run's config (paths resolved) as a run in ``run_dir`` reading ``traffic`` (its ``newest``
    conversations; every one with None) instead of its prompts, evaluated at the served K."""
    data = json.loads(json.dumps(served.model_dump(mode="json", exclude={"source"})))
    data["run_dir"] = str(run_dir.resolve())
    data["data"] |= {"prompts": None, "traffic": {"path": str(traffic.resolve()), "newest": newest}}
    data["evaluate"] |= {"prompts": None, "num_speculative_tokens": [k], "temperatures": [0.0], "suites": []}
    return data


def write_run_config(run_dir: Path, data: dict, why: str) -> Path:
    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, f"# Written by `eaglekit adapt`: {why}.\n" + yaml.safe_dump(data, sort_keys=False))
    return path


def write_adapt_config(
    served_run: Path,
    adapt_dir: Path,
    traffic: Path,
    folder: Path,
    k: int,
    samples: int = SAMPLES,
    steps: int = STEPS,
    lr: float = LR,
    heldout: float = HELDOUT,
    engine: bool = True,
) -> Path:
    """``adapt_dir/config.yaml``: the served run's config (paths resolved) finetuning ``folder`` on ``traffic``."""

    served = served_config(served_run)
    data = traffic_run(served, adapt_dir, traffic, k, samples)
    data["data"]["eval_fraction"] = heldout
    train = data["train"]
    train |= {
        "init_from": str(folder.resolve()),
        # the traffic's draft vocabulary, the served drafter's rows carried over: a shifted mix drafts tokens the
        # served vocabulary lacks (kept, 240 steps on the demo's shift reached 3.18; remapped, 3.61, against 3.41
        # from scratch on more conversations: benchmarks/results/after-shipping.md); a block drafter drafts over
        # the target's whole vocabulary and has none to remap
        "remap_vocab": served.train.draft.has_draft_vocab,
        "max_steps": steps,
        "lr": lr,
        "warmup_steps": min(train.get("warmup_steps") or 0, max(steps // 10, 1)),
        "eval_every": max(steps // 2, 1),
        "save_every": max(steps // 2, 1),
    }
    verify = data["verify"]
    verify |= {"server": None, "num_speculative_tokens": [k], "formats": [served_form(folder)], "suites": []}
    verify["engine"] = "vllm" if engine else None
    return write_run_config(adapt_dir, data, "the served drafter finetuned on its traffic")


def write_scratch_config(served_run: Path, scratch_dir: Path, traffic: Path, k: int) -> Path:
    """``scratch_dir/config.yaml``: what adapt is measured against, a drafter trained from scratch on the whole of
    ``traffic`` with the served run's own recipe (its steps, learning rate and held-out share; no ``init_from``),
    evaluated at K offline (no engine). ``finetune`` runs it."""
    data = traffic_run(served_config(served_run), scratch_dir, traffic, k, None)
    data["train"] |= {"init_from": None, "remap_vocab": False}
    data["verify"] |= {"engine": None, "server": None}
    return write_run_config(scratch_dir, data, "a drafter from scratch on the traffic, adapt's yardstick")


def snapshot(traffic: Path, into: Path) -> Path:
    """The log as it is now, copied into the adapt run (once): the gateway goes on appending to its own, and every
    stage after generate, verify's among them, must read the conversations the finetune read."""
    if into.exists():
        return into
    if not traffic.exists():
        raise UsageError(f"--traffic {traffic} does not exist", "name the gateway's log file or folder of *.jsonl")
    files = [traffic] if traffic.is_file() else sorted(traffic.glob("*.jsonl"))
    partial = into.with_name(into.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in files:
        shutil.copy2(f, partial / f.name)
    partial.rename(into)
    return into


def finetune(config: Path) -> Path:
    """Run the adapt (or scratch) run through export; the candidate folder (the served form of its drafter)."""

    cfg = load_config(config)
    pipeline.run_stages(cfg, pipeline.select_stages(cfg, until="export"))
    return cfg.run_path / "export" / (cfg.verify.formats or ["eagle3"])[0]


# ---------------------------------------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    """Current and candidate drafter on the same held-out prompts at K: τ (vLLM's, 1 + accepted / drafts) and
    the paired interval of their difference."""

    k: int
    prompts: int
    current_tau: float
    candidate_tau: float
    low: float  # the interval of candidate τ - current τ
    high: float
    min_gain: float = MIN_GAIN

    @property
    def gain(self) -> float:
        return self.candidate_tau / self.current_tau - 1

    @property
    def better(self) -> bool:
        return self.low > 0 and self.gain >= self.min_gain

    def verdict(self) -> str:
        figures = (
            f"K={self.k}, {self.prompts} held-out prompts of the traffic: candidate τ {self.candidate_tau:.3f}, "
            f"current {self.current_tau:.3f} (difference {self.candidate_tau - self.current_tau:+.3f}, 95 % interval "
            f"{self.low:+.3f} to {self.high:+.3f})"
        )
        if self.better:
            return f"better: {figures}"
        if self.low <= 0 < self.high:
            why = "the interval holds zero: not better beyond noise"
        elif self.high <= 0:
            why = "worse"
        else:
            why = f"a gain of {self.gain:.1%} is below the {self.min_gain:.0%} worth a swap"
        return f"refused ({why}): {figures}"

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "prompts": self.prompts,
            "current_tau": round(self.current_tau, 4),
            "candidate_tau": round(self.candidate_tau, 4),
            "interval": [round(self.low, 4), round(self.high, 4)],
            "min_gain": self.min_gain,
            "better": self.better,
        }


def paired(
    current: list[tuple[int, int]], candidate: list[tuple[int, int]], k: int, min_gain: float = MIN_GAIN
) -> Comparison:
    """The comparison of per-prompt (drafts, accepted tokens) of the two drafters on the same prompts. τ is a
    ratio of sums, so each prompt's part in it is linearised (its accepted tokens less the pooled rate times its
    drafts, over the mean drafts); the two drafters' parts are differenced prompt by prompt."""
    n = len(current)
    if n < 2 or len(candidate) != n:
        raise EaglekitError(
            f"the comparison needs the same prompts for both drafters, at least 2 (got {n} and {len(candidate)})",
            "hold out more of the traffic (--heldout) or read more of it (--samples)",
        )

    def rate(rows: list[tuple[int, int]]) -> tuple[float, float]:
        drafts = sum(d for d, _ in rows)
        return (sum(a for _, a in rows) / drafts if drafts else 0.0), max(drafts / n, 1e-9)

    (r_cur, d_cur), (r_new, d_new) = rate(current), rate(candidate)
    parts = [
        (an - r_new * dn) / d_new - (ac - r_cur * dc) / d_cur
        for (dc, ac), (dn, an) in zip(current, candidate, strict=True)
    ]
    mean = sum(parts) / n
    se = math.sqrt(sum((p - mean) ** 2 for p in parts) / (n - 1) / n)
    diff = r_new - r_cur
    half = watch.critical(Z_PROMOTE, n - 1) * se
    return Comparison(k, n, 1 + r_cur, 1 + r_new, diff - half, diff + half, min_gain)


def decode_counts(
    cfg,
    folders: dict[str, Path],
    k: int,
    prompts: list[tuple[str, list[dict]]] | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, list[tuple[int, int]]]:
    """Per drafter folder, per prompt ((id, messages); default the held-out split of the run's data): (drafts,
    accepted tokens) at K, greedy, up to ``max_new_tokens`` (default evaluate's), counted as vLLM counts
    (``engine_accounting``: what the engine's counters would say of the same requests)."""
    import torch  # lazy: heavy (torch)

    from eaglekit.drafters.checked import load_checked_drafter, on_target  # lazy: heavy (torch)
    from eaglekit.drafters.registry import proposer_for  # lazy: heavy (torch)
    from eaglekit.model.target import load_target  # lazy: heavy (torch)
    from eaglekit.speculative.decode import generate  # lazy: heavy (torch)
    from eaglekit.speculative.inputs import decode_threads, heldout_prompts, tokenize_prompts  # lazy: heavy (torch)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(cfg.target, device if not cfg.target.device_map else None)
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    stop = end_of_turn_token_ids(tokenizer)
    max_new = max_new_tokens or cfg.evaluate.max_new_tokens
    out: dict[str, list[tuple[int, int]]] = {}
    with decode_threads(target):
        for name, folder in folders.items():
            one = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"checkpoint": str(folder)})})
            drafter, info, hf, aux = load_checked_drafter(one)
            drafter = on_target(drafter, info, target, device)
            source = prompts if prompts is not None else heldout_prompts(cfg, 10**9)
            tokenized, _ = tokenize_prompts(cfg, tokenizer, hf, source, max_new, "adapt")
            rows = []
            for _, ids in tokenized:
                stats = generate(
                    target,
                    ids,
                    max_new,
                    proposer=proposer_for(drafter, aux),
                    k=k,
                    stop_ids=stop,
                    engine_accounting=True,
                ).stats
                rows.append((stats.drafted[0] if stats.drafted else 0, sum(stats.accepted)))
            out[name] = rows
    return out


def counted_tau(rows: list[tuple[int, int]]) -> float:
    """vLLM's τ over per-prompt (drafts, accepted tokens): 1 + accepted / drafts."""
    return 1 + sum(a for _, a in rows) / max(sum(d for d, _ in rows), 1)


def compare(config: Path, current: Path, candidate: Path, k: int, min_gain: float = MIN_GAIN) -> Comparison:

    counts = decode_counts(load_config(config), {"current": current, "candidate": candidate}, k)
    return paired(counts["current"], counts["candidate"], k, min_gain)


def verify_candidate(config: Path) -> dict:
    """The run's verify stage (the candidate served in the engine at K); its report, refused when it failed."""

    cfg = load_config(config)
    if not (cfg.verify.engine or cfg.verify.server):
        raise EaglekitError(
            "no engine to verify the candidate in: no vLLM environment was found",
            "install it (scripts/setup.sh --vllm) or point verify.python at one, then rerun adapt (the finetune is kept)",
        )
    pipeline.run_stages(cfg, ["verify"])
    report = watch.read_report(cfg.run_path / "verify" / "report.json") or {}
    if report.get("verdict") != "PASS":
        raise EaglekitError(
            f"verify did not pass for the candidate ({report.get('verdict', 'no report')}): see "
            f"{cfg.run_path / 'verify' / 'report.md'}",
            "the engine does not serve the candidate as eaglekit measured it: read verify's diagnosis",
        )
    return report


# ------------------------------------------------------------------------------------------------ promotion


class Promotion(Protocol):
    """How the candidate comes to serve: ``promote`` returns the URL whose counters now count it (None: the user
    switches, and confirms later), ``rollback`` makes the previous drafter serve again, ``settle`` releases it."""

    name: str

    def promote(self, candidate: Path) -> str | None: ...

    def rollback(self) -> None: ...

    def settle(self) -> None: ...


class Gateway:
    """A gateway in front of eaglekit's own servers: one stable URL, the backend switched underneath, and every
    chat-completions exchange appended to ``log`` as gateways log them (``{"request": ..., "response": ...}``)."""

    def __init__(self, backend: str, log: Path | None = None):
        self.backend, self.log, self.lock = backend, log, threading.Lock()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                backend = gateway.backend
                try:
                    response = httpx.request(
                        method,
                        backend + self.path,
                        content=body,
                        headers={"Content-Type": "application/json"},
                        timeout=600,
                    )
                except httpx.HTTPError as err:
                    response = httpx.Response(502, json={"error": f"backend {backend}: {err}"})
                self.send_response(response.status_code)
                self.send_header("Content-Type", response.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)
                if gateway.log and body and self.path.endswith("/chat/completions") and response.status_code == 200:
                    line = json.dumps({"request": json.loads(body), "response": response.json()})
                    with gateway.lock, open(gateway.log, "a", encoding="utf-8") as f:
                        f.write(line + "\n")

            def do_GET(self) -> None:
                self.relay("GET")

            def do_POST(self) -> None:
                self.relay("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.root = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ServerPool:
    """eaglekit's own vLLM servers behind a ``Gateway``: the candidate is started beside the current drafter's
    server and the gateway switched to it once it is ready; rollback switches back and stops it."""

    name = "second server"

    def __init__(
        self,
        python: Path,
        target: str,
        k: int,
        log_dir: Path,
        args: list[str] | None = None,
        traffic_log: Path | None = None,
    ):
        self.python, self.target, self.k, self.log_dir = python, target, k, log_dir
        self.args = args or ["--max-model-len", "1024"]
        self.servers: list[Any] = []
        self.active: Any = None
        self.previous: Any = None
        self.traffic_log = traffic_log
        self.gateway: Gateway | None = None

    def serve(self, folder: Path) -> Any:
        """A server for ``folder`` started and ready (dev mode: /server_info tells watch its settings)."""
        from eaglekit.drafters.registry import vllm_speculative_config  # lazy: heavy (torch)

        spec = vllm_speculative_config(served_form(folder), folder, self.k)
        log = self.log_dir / f"vllm-{len(self.servers)}-{folder.parent.parent.name}.log"
        server = VllmServer(
            self.python,
            self.target,
            ["--speculative-config", json.dumps(spec), *self.args],
            log,
            env={"VLLM_SERVER_DEV_MODE": "1"},
        )
        self.servers.append(server)
        server.__enter__()
        return server

    def start(self, folder: Path) -> str:
        """The current drafter's server and the gateway in front of it; the gateway's URL."""
        self.active = self.serve(folder)
        self.gateway = Gateway(self.active.root, self.traffic_log)
        return self.gateway.root

    def promote(self, candidate: Path) -> str:
        server = self.serve(candidate)  # fails before anything is switched
        assert self.gateway is not None
        self.previous, self.active = self.active, server
        self.gateway.backend = server.root
        return server.root

    def rollback(self) -> None:
        if self.previous is None:
            return
        assert self.gateway is not None
        self.gateway.backend = self.previous.root
        self.active.stop()
        self.active, self.previous = self.previous, None

    def settle(self) -> None:
        if self.previous is not None:
            self.previous.stop()
            self.previous = None

    def close(self) -> None:
        if self.gateway:
            self.gateway.close()
        for server in self.servers:
            server.stop()


# vLLM 0.32's weight-transfer backends that can retarget a draft model (``supports_draft_weight_update``);
# sparse_nccl, sharded_rdt and nccl_m2n say they cannot
DRAFT_BACKENDS = ("nccl", "ipc")

# Run with the engine's Python on the engine's machine (a CUDA device): the candidate's weights through vLLM's own
# trainer-side IPC engine and HTTP client, the session started with /start_draft_weight_update (the HTTP client's
# start_weight_update would retarget the target model).
LIVE_SENDER = r"""
import sys, torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

url, weights_file, version = sys.argv[1:4]
weights = {name: t.cuda() for name, t in load_file(weights_file).items()}

class Tensors(WeightSource):
    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]
    def __iter__(self):
        return iter(list(weights.items()))

class DraftClient(HTTPVLLMWeightSyncClient):
    def start_weight_update(self):
        self._post("start_draft_weight_update")
    def finish_weight_update(self, weight_version=None):
        super().finish_weight_update(version)

engine = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0), client=DraftClient(url), source=Tensors())
engine.send_weights()
"""


class LiveDraftUpdate:
    """vLLM's runtime draft weight update (vllm#46725): the candidate's weights loaded into the running server's
    draft model, no restart; rollback loads the previous drafter's. UNVERIFIED here: vLLM's CPU build has the
    routes but no transfer backend that runs on CPU (``unsupported``)."""

    name = "live draft weight update"

    def __init__(self, url: str, python: Path, current: Path, timeout: float = 600.0):

        self.root, self.python, self.current, self.timeout = root_of(url), python, current, timeout

    @staticmethod
    def unsupported(url: str, python: Path | None, timeout: float = 10.0) -> str | None:
        """Why the server at ``url`` cannot take the candidate's weights live; None when it can."""

        root = root_of(url)
        try:
            routes = httpx.get(f"{root}/weight_info", timeout=timeout).status_code == 200
        except httpx.HTTPError as err:
            return f"{root} does not answer ({type(err).__name__})"
        if not routes:
            return (
                f"{root} has no weight-update routes (vLLM mounts /start_draft_weight_update, /update_weights and "
                "/finish_weight_update with VLLM_SERVER_DEV_MODE=1 only)"
            )
        config = from_server(root, timeout) or {}
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend not in DRAFT_BACKENDS:
            return (
                f"{root} was started without a weight-transfer backend that updates a draft model "
                f"(--weight-transfer-config backend {backend or 'unset'}; one of {', '.join(DRAFT_BACKENDS)} does)"
            )
        if backend != "ipc":
            return f"backend {backend} needs a rendezvous with the trainer's ranks: eaglekit sends over ipc only"
        if python is None or is_cpu_build(python):
            return (
                "vLLM's CPU build: its weight-transfer backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) move "
                "CUDA tensors (NCCL broadcasts, CUDA IPC handles); none runs on CPU"
            )
        return None

    def send(self, folder: Path) -> str:
        weights = folder / "model.safetensors"
        version = f"eaglekit:{hashlib.sha256(weights.read_bytes()).hexdigest()[:16]}"  # what /weight_info then says
        proc = subprocess.run(
            [str(self.python), "-c", LIVE_SENDER, self.root, str(weights), version],
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        if proc.returncode != 0:
            raise EaglekitError(
                f"the live draft weight update to {self.root} failed: {proc.stderr.strip()[-1500:]}",
                "the server keeps serving what it served; read its log",
            )
        served = httpx.get(f"{self.root}/weight_info", timeout=30).json().get("weight_version")
        if served != version:
            raise EaglekitError(
                f"{self.root} reports weight version {served} after the update, not {version}",
                "read the server's log: the draft update did not finish",
            )
        return self.root

    def promote(self, candidate: Path) -> str:
        return self.send(candidate)

    def rollback(self) -> None:
        self.send(self.current)

    def settle(self) -> None:
        pass


@dataclass
class PrintedSwitch:
    """The user's own servers: the command that starts the candidate's server and what to run after switching."""

    target: str
    k: int
    url: str
    adapt_dir: Path
    say: Callable[[str], None] = print
    name: str = "second server (printed)"

    def promote(self, candidate: Path) -> str | None:
        from eaglekit.drafters.registry import vllm_speculative_config  # lazy: heavy (torch)

        spec = json.dumps(vllm_speculative_config(served_form(candidate), candidate, self.k))
        self.say(
            "adapt: start the candidate's server beside the current one (another port):\n"
            f"  vllm serve {self.target} --speculative-config '{spec}' --port PORT\n"
            "then switch your gateway to it, and let watch confirm it (it rolls back by telling you to switch back):\n"
            f"  eaglekit adapt {self.adapt_dir} --confirm http://HOST:PORT --previous {self.url}"
        )
        return None

    def rollback(self) -> None:
        self.say(f"adapt: switch your gateway back to {self.url} (it still serves the previous drafter)")

    def settle(self) -> None:
        self.say(f"adapt: the previous drafter's server ({self.url}) can be stopped")


# ------------------------------------------------------------------------------------------------- confirming


def confirm(
    adapt_dir: Path,
    url: str,
    windows: int = CONFIRM_WINDOWS,
    window_requests: int = WINDOW_REQUESTS,
    timeout_s: float = CONFIRM_TIMEOUT_S,
    temperature: float = 0.0,
    emit: Callable[[str], None] = print,
    poll_s: float = 0.5,
) -> list[dict]:
    """watch's windows on ``url`` against the candidate's own figures (the adapt run's verify and evaluate), until
    ``windows`` windows, a window below the band, or ``timeout_s`` with too little traffic (an error)."""
    refs = watch.references(adapt_dir)
    client = watch.connect(url)
    served = watch.served_setup(client, None, temperature)
    before, started = client.snapshot(), time.monotonic()
    deadline = started + timeout_s
    records: list[dict] = []
    while len(records) < windows:
        time.sleep(poll_s)
        after = client.snapshot()
        if after.requests - before.requests < window_requests:
            if time.monotonic() > deadline:
                raise EaglekitError(
                    f"{url} finished {after.requests - before.requests:.0f} requests in {timeout_s:.0f} s, fewer than "
                    f"a window's {window_requests}: nothing to confirm the candidate with",
                    "send traffic to it, or confirm later with `eaglekit adapt ADAPT_DIR --confirm URL`",
                )
            continue
        now = time.monotonic()
        rec = watch.compare(watch.Window.between(len(records) + 1, now - started, before, after), refs, served)
        emit(watch.line(rec))
        records.append(rec)
        before, started = after, now
        if rec["status"] == "low":
            break
    return records


def confirmed(records: list[dict]) -> bool:
    return bool(records) and all(r["status"] in ("ok", "high") for r in records)


# ------------------------------------------------------------------------------------------------------ adapt


@dataclass
class Outcome:
    status: str  # promoted | refused | failed | rolled back | pending
    detail: str
    comparison: Comparison | None = None
    windows: list[dict] = field(default_factory=list)
    url: str | None = None  # what serves the candidate (promoted) or the previous drafter (otherwise)

    @property
    def code(self) -> int:
        return 0 if self.status in ("promoted", "pending") else 1


def adapt(
    served_run: Path,
    traffic: Path,
    adapt_dir: Path,
    folder: Path,
    k: int,
    promotion: Promotion,
    *,
    samples: int = SAMPLES,
    steps: int = STEPS,
    lr: float = LR,
    heldout: float = HELDOUT,
    min_gain: float = MIN_GAIN,
    windows: int = CONFIRM_WINDOWS,
    window_requests: int = WINDOW_REQUESTS,
    confirm_timeout_s: float = CONFIRM_TIMEOUT_S,
    engine: bool = True,
    say: Callable[[str], None] = print,
) -> Outcome:
    """Every step in order; the first that fails or refuses ends it with the current drafter serving."""
    traffic = snapshot(traffic, adapt_dir / "traffic")
    config = write_adapt_config(served_run, adapt_dir, traffic, folder, k, samples, steps, lr, heldout, engine)
    record(adapt_dir, "start", served_run=str(served_run), drafter=str(folder), k=k, traffic=str(traffic))
    t0 = time.monotonic()
    candidate = finetune(config)
    record(adapt_dir, "finetune", candidate=str(candidate), seconds=round(time.monotonic() - t0, 1))
    t0 = time.monotonic()
    result = compare(config, folder, candidate, k, min_gain)
    record(adapt_dir, "compare", **result.as_dict(), seconds=round(time.monotonic() - t0, 1))
    say(f"adapt: {result.verdict()}")
    if not result.better:
        record(adapt_dir, "refused", why=result.verdict())
        return Outcome("refused", result.verdict(), result)
    return promote(adapt_dir, config, candidate, promotion, result, windows, window_requests, confirm_timeout_s, say)


def promote(
    adapt_dir: Path,
    config: Path,
    candidate: Path,
    promotion: Promotion,
    result: Comparison | None = None,
    windows: int = CONFIRM_WINDOWS,
    window_requests: int = WINDOW_REQUESTS,
    confirm_timeout_s: float = CONFIRM_TIMEOUT_S,
    say: Callable[[str], None] = print,
) -> Outcome:
    """verify, swap, confirm; any failure leaves (or puts back) the current drafter serving."""
    t0 = time.monotonic()
    try:
        report = verify_candidate(config)
    except EaglekitError as err:
        record(adapt_dir, "promotion failed", at="verify", why=err.message)
        say(f"adapt: verify failed; the current drafter keeps serving: {err.message}")
        return Outcome("failed", err.message, result)
    runs = report.get("runs") or [{}]
    record(
        adapt_dir, "verify", verdict=report["verdict"], tau=runs[0].get("tau"), seconds=round(time.monotonic() - t0, 1)
    )
    t0 = time.monotonic()
    try:
        url = promotion.promote(candidate)
    except EaglekitError as err:
        record(adapt_dir, "promotion failed", at="swap", how=promotion.name, why=err.message)
        say(f"adapt: the swap failed; the current drafter keeps serving: {err.message}")
        return Outcome("failed", err.message, result)
    record(adapt_dir, "swap", how=promotion.name, url=url, seconds=round(time.monotonic() - t0, 1))
    if url is None:
        record(adapt_dir, "pending", why="the user switches to the candidate's server and runs --confirm")
        return Outcome("pending", "start the candidate's server, switch, then confirm", result)
    return confirm_or_roll_back(adapt_dir, url, promotion, result, windows, window_requests, confirm_timeout_s, say)


def confirm_or_roll_back(
    adapt_dir: Path,
    url: str,
    promotion: Promotion,
    result: Comparison | None = None,
    windows: int = CONFIRM_WINDOWS,
    window_requests: int = WINDOW_REQUESTS,
    confirm_timeout_s: float = CONFIRM_TIMEOUT_S,
    say: Callable[[str], None] = print,
) -> Outcome:
    t0 = time.monotonic()
    try:
        records = confirm(
            adapt_dir, url, windows, window_requests, confirm_timeout_s, emit=lambda t: say(f"watch: {t}")
        )
    except EaglekitError as err:
        records, why = [], err.message
    else:
        why = "" if confirmed(records) else "served τ fell below the candidate's band"
    statuses = [r["status"] for r in records]
    if why:
        promotion.rollback()
        record(adapt_dir, "rolled back", why=why, windows=statuses, seconds=round(time.monotonic() - t0, 1))
        say(f"adapt: rolled back ({why}); the previous drafter serves again")
        return Outcome("rolled back", why, result, records)
    promotion.settle()
    taus = [r.get("tau") for r in records]
    record(adapt_dir, "promoted", url=url, windows=statuses, tau=taus, seconds=round(time.monotonic() - t0, 1))
    say(f"adapt: promoted: {url} serves the candidate, watch confirmed it over {len(records)} windows")
    return Outcome("promoted", "confirmed by watch", result, records, url)
