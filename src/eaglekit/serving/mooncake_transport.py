"""Hidden states through a Mooncake store: the client side of ``extract.stream.transport: mooncake``.

The servers run vLLM's ``extract_hidden_states`` method with speculators' ``MooncakeHiddenStatesConnector`` (the
``hs-connectors`` package, loaded by ``kv_connector_module_path``) instead of the file connector. Read in
hs-connectors 0.9.0 (``mooncake_hidden_states_connector.py``, ``mooncake_store.py``, ``transfer.py``):

- the key (``handle``) is the engine request id with every character outside ``[A-Za-z0-9_-]`` made ``_`` (and a
  ``k`` before a leading digit), so ``cmpl-{our request_id}-{choice}-{8 hex}`` is its own key;
- the reply's ``kv_transfer_params`` is the transfer manifest: ``handle``, ``version`` 1, ``tensors`` (for
  ``hidden_states`` [tokens, states, hidden] in the model dtype and ``token_ids`` [tokens] int64: ``shape``,
  ``dtype`` as torch prints it, ``nbytes``, ``offset``) and ``metadata.total_aligned_bytes``;
- the store holds one raw object under the handle: the two tensors' bytes at their offsets (each 64-byte aligned),
  put by a writer thread a few milliseconds *after* the reply; a put is visible whole or not at all. A write that
  failed puts ``{handle}:error`` (JSON ``{"error": ...}``) instead;
- the object lives in the memory a server lends the store (its ``global_segment_size``) until a reader removes it
  (``remove(key, force=True)``); nothing else does, but the master evicts objects when the segments pass 90% full.

So ``locate`` reads the manifest, ``wait_ready`` polls for the object or its error marker, ``receive`` reads it into
a registered buffer, cuts the tensors out by the manifest and removes both keys; the token check and the final
norm are the file spool's (``FeatureClient._read``). This process lends the store no memory (segment size 0).

A Mooncake call answers a negative status rather than raising. ``RPC_FAIL``/``RPC_TIMEOUT`` mean the master does not
answer: the call is tried again until ``extract.vllm.outage_timeout`` has passed since the first such answer, then
``TransportGone`` stops the run as every server gone does. Any other failure concerns one object (evicted, its server
died and took its segment along, a transfer that failed): the request is sent again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from eaglekit.config import MooncakeStoreConfig
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.serving.vllm_features import CONVERT_SLOTS, SendAgain, ServerSetupError, TransportGone

CONNECTOR = "MooncakeHiddenStatesConnector"
CONNECTOR_MODULE = "hs_connectors.mooncake_hidden_states_connector"
MANIFEST_VERSION = 1  # hs-connectors 0.9.0's transfer manifest
OBJECT_NOT_FOUND = -704
MASTER_UNREACHABLE = (-900, -901)  # RPC_FAIL, RPC_TIMEOUT (Mooncake's types.h ErrorCode)
SAFE_READ_FAILURES = (-200, -703, -704, -705, -707, *MASTER_UNREACHABLE)  # returned before or after the transfer ran
RECEIVE_STAGING = 64 << 20  # this client's own Mooncake buffer: the reads go to registered buffers of ours
BUFFER_GRANULE = 64 << 20  # receive buffers grow in these steps (registered once, reused)
POLL_FIRST, POLL_MAX = 0.001, 0.05  # seconds between two looks for a request's object
MASTER_PROBE = 5.0  # seconds to connect to the master before setup (whose own retries take 90 s)
INSTALL = "pip install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)"

T = TypeVar("T")


@dataclass
class Entry:
    """One request's hidden states in the store, as its reply's manifest describes them."""

    handle: str
    server: str
    size: int  # total_aligned_bytes: the object's bytes in the store
    tensors: dict[str, tuple[list[int], torch.dtype, int, int]]  # name: shape, dtype, offset, nbytes
    located: float

    @property
    def name(self) -> str:  # how FeatureClient names what it read (the file spool's Path has .name)
        return self.handle

    @property
    def error_key(self) -> str:
        return self.handle + ":error"


def local_hostname(settings: MooncakeStoreConfig) -> str:
    """This machine's address as the servers reach it, found as hs-connectors finds a server's."""
    return (
        settings.local_hostname
        or os.environ.get("MOONCAKE_LOCAL_HOSTNAME")
        or socket.gethostbyname(socket.gethostname())
    )


# Stands for each server's own address in its --kv-transfer-config; the shell puts it in (shell_kv_transfer_config).
SERVER_HOSTNAME = "@MOONCAKE_LOCAL_HOSTNAME@"
SERVER_HOSTNAME_SHELL = "${MOONCAKE_LOCAL_HOSTNAME:-$(hostname -i | cut -d' ' -f1)}"


def connector_config(settings: MooncakeStoreConfig) -> dict:
    """The servers' ``--kv-transfer-config``: hs-connectors' connector with the store's settings (its own keys and
    defaults); ``local_hostname`` is each server's own address, left for the shell."""
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_connector_extra_config": {
            "mooncake": {
                "local_hostname": SERVER_HOSTNAME,
                "metadata_server": settings.metadata_server,
                "master_server_address": settings.master_server_address,
                "global_segment_size": settings.global_segment_size,
                "local_buffer_size": settings.local_buffer_size,
                "protocol": settings.protocol,
                "device_name": settings.device_name,
            }
        },
    }


def shell_kv_transfer_config(settings: MooncakeStoreConfig) -> str:
    """``connector_config`` as one shell word: the JSON single-quoted, but for the server's address, which the shell
    of each server fills in ($MOONCAKE_LOCAL_HOSTNAME, else its host name's first address, as hs-connectors does)."""
    word = shlex.quote(json.dumps(connector_config(settings), separators=(",", ":")))
    return word.replace(SERVER_HOSTNAME, "'\"" + SERVER_HOSTNAME_SHELL + "\"'")


def _dtype(name: Any) -> torch.dtype | None:
    found = getattr(torch, str(name).removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def parse_manifest(params: dict, server: str) -> Entry:
    """The reply's transfer manifest (raises ServerSetupError when the server is no Mooncake feature source)."""
    restart = "start it with the command `eaglekit serve-command CONFIG` prints"
    if "handle" not in params:
        if params.get("hidden_states_path"):
            raise ServerSetupError(
                f"{server} writes hidden-states files (kv_transfer_params.hidden_states_path) but "
                "extract.stream.transport is mooncake",
                f"{restart}, or set extract.stream.transport: file",
            )
        raise ServerSetupError(
            f"{server} answered without kv_transfer_params.handle: it was not started with speculators' "
            f"{CONNECTOR} (hs-connectors) and the extract_hidden_states method",
            restart,
        )
    if params.get("version") != MANIFEST_VERSION or not isinstance(params.get("tensors"), dict):
        raise ServerSetupError(
            f"{server} answered a hidden-states manifest of version {params.get('version')!r}; eaglekit reads "
            f"version {MANIFEST_VERSION} (hs-connectors 0.9.0, whose reply carries the tensors' layout)",
            "install hs-connectors==0.9.0 beside vLLM on the servers and restart them",
        )
    tensors = {}
    try:
        for name in ("hidden_states", "token_ids"):
            spec = params["tensors"][name]
            dtype = _dtype(spec["dtype"])
            shape, offset, nbytes = [int(d) for d in spec["shape"]], int(spec["offset"]), int(spec["nbytes"])
            if dtype is None or nbytes != torch.Size(shape).numel() * dtype.itemsize or offset < 0:
                raise ValueError(f"{name}: {spec}")
            tensors[name] = (shape, dtype, offset, nbytes)
        size = int(params["metadata"]["total_aligned_bytes"])
    except (KeyError, TypeError, ValueError) as err:
        raise ServerSetupError(
            f"{server} answered a hidden-states manifest eaglekit cannot read ({type(err).__name__}: {err})",
            "install hs-connectors==0.9.0 beside vLLM on the servers and restart them",
        ) from None
    if any(offset + nbytes > size for _, _, offset, nbytes in tensors.values()):
        raise ServerSetupError(f"{server}: its manifest places a tensor past the object's {size} bytes", restart)
    return Entry(str(params["handle"]), server, size, tensors, time.monotonic())


def open_store(settings: MooncakeStoreConfig) -> Any:
    """A Mooncake client of the master that lends no memory (the servers' segments hold the hidden states)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # lazy: optional (installed where its transport serves)
    except ImportError as err:
        missing = re.search(r"(lib[\w.+-]+\.so[\w.]*)", str(err))
        if missing:
            raise UsageError(
                f"the mooncake package is installed but cannot load {missing.group(1)} ({err})",
                "install the RDMA verbs library it links against: apt-get install libibverbs1 "
                "(Debian/Ubuntu; rdma-core's libibverbs elsewhere), even for TCP",
            ) from None
        raise UsageError(
            "extract.stream.transport is mooncake but the mooncake package is not installed",
            f"{INSTALL} into eaglekit's environment (or `pip install eaglekit[mooncake]`)",
        ) from None
    host, _, port = settings.master_server_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=MASTER_PROBE).close()
    except (OSError, ValueError) as err:
        raise TransportGone(
            f"no Mooncake master answers at extract.stream.mooncake.master_server_address "
            f"{settings.master_server_address} ({type(err).__name__}: {err})",
            "start it where the servers and this machine reach it (`mooncake_master --rpc_port PORT`, from the "
            "mooncake-transfer-engine package) or fix the address",
        ) from None
    store = MooncakeDistributedStore()
    status = store.setup(
        local_hostname(settings),
        settings.metadata_server,
        0,
        RECEIVE_STAGING,
        settings.protocol,
        settings.device_name,
        settings.master_server_address,
    )
    if status != 0:
        raise EaglekitError(
            f"joining the Mooncake store at {settings.master_server_address} failed (status {status}; "
            f"metadata_server {settings.metadata_server}, protocol {settings.protocol}, local_hostname "
            f"{local_hostname(settings)})",
            "check extract.stream.mooncake against the servers' kv_connector_extra_config.mooncake, and that "
            "local_hostname is an address of this machine the servers reach ($MOONCAKE_LOCAL_HOSTNAME)",
        )
    return store


class MooncakeTransport:
    """The Mooncake store transport (see the module). Connects on first use; safe from several threads."""

    def __init__(self, settings: MooncakeStoreConfig, timeout: float, outage_timeout: float):
        self.settings, self.timeout, self.outage_timeout = settings, timeout, outage_timeout
        self._store: Any = None
        self._lock = threading.Lock()
        self._located: dict[str, Entry] = {}  # handles a reply named, not yet received
        self._buffers: list[torch.Tensor] = []  # registered receive buffers not in use
        self._kept: list[torch.Tensor] = []  # buffers a failed transfer may still write into: never reused or freed
        self._master_gone = False  # set with TransportGone: cleaning up then would only wait on the master again

    @property
    def store(self) -> Any:
        with self._lock:
            if self._store is None:
                self._store = open_store(self.settings)
            return self._store

    def close(self) -> None:
        """Leave the store (a client left open retries a master that is gone for a while as the process exits)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    # ----------------------------------------------------------------------------- FeatureTransport

    def locate(self, params: dict, server: str) -> Entry:
        entry = parse_manifest(params, server)
        with self._lock:
            self._located[entry.handle] = entry
        return entry

    def wait_ready(self, where: Entry) -> None:
        deadline, delay = where.located + self.timeout, POLL_FIRST
        while True:
            present = self._ask(lambda: self.store.batch_is_exist([where.handle, where.error_key]))
            if any(flag == 1 for flag in present):
                return
            if time.monotonic() > deadline:
                self._forget(where)
                raise SendAgain(f"its hidden states were not in the Mooncake store after {self.timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    def receive(self, where: Entry) -> tuple[dict[str, torch.Tensor], int]:
        try:
            if self._ask(lambda: self.store.is_exist(where.error_key)) == 1:
                raise SendAgain(f"its server could not put the hidden states: {self._error_of(where)}")
            size = self._ask(lambda: self.store.get_size(where.handle))
            if size != where.size:
                raise SendAgain(
                    f"its Mooncake object {where.handle} is gone or of another size than its manifest says "
                    f"({size} vs {where.size} bytes; evicted, or its server died)"
                )
            buffer = self._take_buffer(size)
            got = self._ask(lambda: self.store.get_into(where.handle, buffer.data_ptr(), size))
            if got != size:
                if got in SAFE_READ_FAILURES:
                    self._give_buffer(buffer)
                else:
                    self._kept.append(buffer)
                raise SendAgain(f"reading its Mooncake object {where.handle} failed (status {got})")
            tensors = {
                name: buffer[offset : offset + nbytes].view(dtype).view(shape).clone()
                for name, (shape, dtype, offset, nbytes) in where.tensors.items()
            }
            self._give_buffer(buffer)
            return tensors, size
        finally:
            self._forget(where)

    def held_bytes(self, prefix: str) -> int:
        """The located objects of this prefix the store holds now: measured (their presence, asked in one call), or
        all of them while the master does not answer (a measurement never waits out an outage)."""
        with self._lock:
            entries = [e for e in self._located.values() if e.handle.startswith(f"cmpl-{prefix}-")]
        if not entries:
            return 0
        present = self.store.batch_is_exist([e.handle for e in entries])
        return sum(e.size for e, flag in zip(entries, present, strict=True) if flag == 1 or flag < 0)

    def remove_leftovers(self, prefix: str) -> int:
        """Remove every object of this prefix: what killed attempts and given-up requests left in the store. One
        try: while the master does not answer there is nothing to remove, and the next run's call takes them."""
        removed = self.store.remove_by_regex(f"^cmpl-{re.escape(prefix)}-.*", True)
        return max(removed, 0)

    # ------------------------------------------------------------------------------------- helpers

    def _ask(self, call: Callable[[], T]) -> T:
        """A store call, tried again while the master does not answer; TransportGone past outage_timeout."""
        since = None
        while True:
            result = call()
            statuses = result if isinstance(result, list) else [result]
            if not any(s in MASTER_UNREACHABLE for s in statuses):
                return result
            now = time.monotonic()
            since = since if since is not None else now
            if now - since >= self.outage_timeout:
                self._master_gone = True
                raise TransportGone(
                    f"the Mooncake master at {self.settings.master_server_address} has not answered for "
                    f"{self.outage_timeout:g}s (extract.vllm.outage_timeout; status {statuses[0]})",
                    "restart mooncake_master and then the feature servers (their segments join it at start; the "
                    "objects it knew are gone)",
                )
            time.sleep(min(1.0, self.outage_timeout / 10))

    def _error_of(self, where: Entry) -> str:
        raw = self.store.get(where.error_key)
        try:
            return str(json.loads(raw).get("error", "no reason given"))[:500]
        except (ValueError, AttributeError):
            return f"an unreadable error marker ({len(raw)} bytes)"

    def _forget(self, where: Entry) -> None:
        with self._lock:
            self._located.pop(where.handle, None)
        if self._master_gone:  # its objects went with it (a master keeps them in memory only)
            return
        for key in (where.handle, where.error_key):
            self.store.remove(key, True)  # a master gone meanwhile leaves them: the next remove_leftovers takes them

    def _take_buffer(self, size: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._buffers if b.numel() >= size]
            if fits:
                buffer = min(fits, key=lambda b: b.numel())
                self._buffers.remove(buffer)
                return buffer
        buffer = torch.empty(-(-size // BUFFER_GRANULE) * BUFFER_GRANULE, dtype=torch.uint8)
        status = self.store.register_buffer(buffer.data_ptr(), buffer.numel())
        if status != 0:
            raise EaglekitError(
                f"Mooncake refused to register a {buffer.numel()}-byte receive buffer (status {status})",
                "free memory on this machine (with protocol rdma: raise the locked-memory limit, ulimit -l)",
            )
        return buffer

    def _give_buffer(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._buffers.append(buffer)
            if len(self._buffers) > CONVERT_SLOTS:  # more than FeatureClient reads at once: drop the smallest
                smallest = min(self._buffers, key=lambda b: b.numel())
                self._buffers.remove(smallest)
            else:
                return
        self.store.unregister_buffer(smallest.data_ptr())
