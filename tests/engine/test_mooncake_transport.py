"""The Mooncake transport (``extract.stream.transport: mooncake``) against Mooncake's own loopback: a real
``mooncake_master`` from the wheel on 127.0.0.1, real Mooncake clients over TCP with ``P2PHANDSHAKE`` (no metadata
server), in separate processes.

The producer is this file run as a script (``python tests/engine/test_mooncake_transport.py serve ...``): a real HTTP server
on 127.0.0.1 answering ``/v1/completions`` as vLLM does with the hidden-states method, whose put path mirrors
speculators' ``MooncakeHiddenStatesConnector`` of hs-connectors 0.9.0 (written for this test from reading it, not
its code): the reply's ``kv_transfer_params`` is the transfer manifest (``handle`` = the engine request id, tensors'
shapes, dtypes, 64-byte-aligned offsets, ``total_aligned_bytes``), and a writer thread puts the packed bytes under the
handle from a registered staging buffer of a client that lends the store its segment, a few milliseconds after the
reply, or ``{handle}:error`` when told to fail. With ``--mode file`` the same server writes vLLM's
``ExampleHiddenStatesConnector`` file instead, so both transports read the same features of the same request. The
states are a function of the token ids, so a test knows what each request must return.

What this does not run: vLLM with the real connector (it needs a GPU: the connector copies on an accelerator
stream), and RDMA or several nodes (docs/features.md says so).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch


def _mooncake_missing() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        return f"mooncake does not load ({err}): pip install mooncake-transfer-engine-non-cuda, apt-get install libibverbs1"
    return None


MISSING = _mooncake_missing()
needs_mooncake = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
HIDDEN, STATES = 8, 4
SEGMENT = 64 << 20  # what the stand-in server lends the store
ALIGN = 64  # hs-connectors aligns each tensor of the packed object to 64 bytes


def states_of(token_ids: list[int]) -> torch.Tensor:
    """What the stand-in server captures for these tokens: [tokens, states, hidden] in bf16, exact in bf16."""
    t = torch.tensor(token_ids, dtype=torch.float32)[:, None, None]
    s = torch.arange(STATES, dtype=torch.float32)[None, :, None]
    h = torch.arange(HIDDEN, dtype=torch.float32)[None, None, :]
    return ((t % 50) + s * 0.25 + h / 8).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------ the server


def packed_manifest(handle: str, states: torch.Tensor, ids: torch.Tensor) -> dict:
    """hs-connectors 0.9.0's transfer manifest: each tensor at the next 64-byte boundary."""
    tensors, offset = {}, 0
    for name, t in (("hidden_states", states), ("token_ids", ids)):
        nbytes = t.numel() * t.element_size()
        tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "nbytes": nbytes, "offset": offset}
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return {
        "handle": handle,
        "version": 1,
        "tensors": tensors,
        "metadata": {"num_tokens": len(ids), "total_aligned_bytes": offset, "extract_mode": "prompt_only"},
    }


def serve(argv: list[str]) -> None:
    """The stand-in feature server (see the module); prints its port once it listens."""
    import argparse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["mooncake", "file"], required=True)
    parser.add_argument("--master", default="")
    parser.add_argument("--metadata", default="P2PHANDSHAKE")
    parser.add_argument("--storage", default="")
    parser.add_argument("--error-on", type=int, default=0, help="the request number whose put fails")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds the engine takes per request")
    args = parser.parse_args(argv)
    lock, count, peak, handles = threading.Lock(), [0], [0], {}
    store = None
    if args.mode == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", args.metadata, SEGMENT, 16 << 20, "tcp", "", args.master) == 0
        put_done: set[str] = set()

        def measure() -> None:  # the store's bytes of this server's objects, seen from the producer's side
            while True:
                with lock:
                    listed = list(handles.items())
                if listed:
                    flags = store.batch_is_exist([h for h, _ in listed])
                    held = sum(size for (_, size), flag in zip(listed, flags, strict=True) if flag == 1)
                    with lock:
                        peak[0] = max(peak[0], held)
                        for (h, _), flag in zip(listed, flags, strict=True):
                            if flag == 0 and h in put_done:
                                handles.pop(h, None)
                time.sleep(0.002)

        threading.Thread(target=measure, daemon=True).start()

    def put(manifest: dict, states: torch.Tensor, ids: torch.Tensor, fail: bool) -> None:
        time.sleep(0.005)  # vLLM answers before the connector's writer thread has put the sample
        handle = manifest["handle"]
        if fail:
            store.put(handle + ":error", json.dumps({"error": "Non-finite producer tensor"}).encode())
            return
        staging = torch.zeros(manifest["metadata"]["total_aligned_bytes"], dtype=torch.uint8)
        for name, t in (("hidden_states", states), ("token_ids", ids)):
            spec = manifest["tensors"][name]
            staging[spec["offset"] : spec["offset"] + spec["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
        assert store.register_buffer(staging.data_ptr(), staging.numel()) == 0
        with lock:
            handles[handle] = staging.numel()
        store.put_from(handle, staging.data_ptr(), staging.numel())
        with lock:
            put_done.add(handle)
        store.unregister_buffer(staging.data_ptr())

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def answer(self, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            with lock:
                self.answer({"peak": peak[0], "requests": count[0]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                count[0] += 1
                n = count[0]
            token_ids = body["prompt"]
            engine_id = f"cmpl-{body['request_id']}-0-{os.urandom(4).hex()}"  # vLLM's id for /v1/completions
            states, ids = states_of(token_ids), torch.tensor(token_ids, dtype=torch.long)
            time.sleep(args.delay)
            if args.mode == "file":
                from safetensors.torch import save_file

                path = Path(args.storage) / f"{engine_id}.safetensors"
                save_file({"hidden_states": states, "token_ids": ids}, str(path))
                params: dict = {"hidden_states_path": str(path)}
            else:
                params = packed_manifest(engine_id, states, ids)
                threading.Thread(target=put, args=(params, states, ids, n == args.error_on), daemon=True).start()
            next_token = (token_ids[-1] + 1) % 50
            self.answer({"choices": [{"text": "", "token_ids": [next_token]}], "kv_transfer_params": params})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


# ----------------------------------------------------------------------------------------------- fixtures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A real mooncake_master from the wheel (the binary itself: the console script forks it) on 127.0.0.1."""

    def __init__(self, log: Path, http_metadata: bool = False):
        import mooncake

        self.port = free_port()
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        args = [str(binary), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"]
        self.metadata_server = "P2PHANDSHAKE"
        if http_metadata:  # the master's own metadata server instead of the peer-to-peer handshake
            port = free_port()
            args += ["--enable_http_metadata_server=true", f"--http_metadata_server_port={port}"]
            args += ["--http_metadata_server_host=127.0.0.1"]
            self.metadata_server = f"http://127.0.0.1:{port}/metadata"
        self.proc = subprocess.Popen(
            [*args, "--metrics_host=127.0.0.1"], stdout=log.open("wb"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Server:
    """The stand-in feature server, in a process of its own."""

    def __init__(self, *args: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        assert line.isdigit(), f"the stand-in server did not start: {line!r}"
        self.url = f"http://127.0.0.1:{line}/v1"

    def status(self) -> dict:
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "master.log")
    yield m
    m.kill()


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(*args: str) -> Server:
        started.append(Server(*args))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def settings(master: Master, **kw):
    from eaglekit.config import MooncakeStoreConfig

    return MooncakeStoreConfig(
        master_server_address=master.address, metadata_server=master.metadata_server, local_hostname="127.0.0.1", **kw
    )


def vllm_cfg(url: str, storage: Path, **kw):
    from eaglekit.config import VllmFeaturesConfig

    return VllmFeaturesConfig(
        servers=[url],
        storage_path=str(storage),
        **{"timeout": 20, "max_retries": 3, "retry_backoff": 0.01, "probe_interval": 0.1, "outage_timeout": 2.0, **kw},
    )


def feature_client(vcfg, transport, prefix: str = "p"):
    from eaglekit.model.target import FinalNorm
    from eaglekit.serving.vllm_features import FeatureClient

    return FeatureClient(
        vcfg, None, "m", [2, 4, 5, 8], HIDDEN, FinalNorm(torch.ones(HIDDEN), 1e-6), prefix, transport=transport
    )


@pytest.fixture
def clients(master):
    """``clients.transport(outage_timeout)`` and ``clients.inspector()`` (a Mooncake client of the test's own, lending
    a segment for what it puts), closed before the master stops (a client left open retries it as the process ends)."""
    from mooncake.store import MooncakeDistributedStore

    from eaglekit.serving.mooncake_transport import MooncakeTransport

    opened: list = []

    class Clients:
        @staticmethod
        def transport(outage_timeout: float = 2.0) -> MooncakeTransport:
            opened.append(MooncakeTransport(settings(master), 20, outage_timeout))
            return opened[-1]

        @staticmethod
        def inspector():
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address) == 0
            opened.append(store)
            return store

    yield Clients
    for client in opened:
        client.close()


SAMPLES = [[1, 2, 3, 4, 5], list(range(7, 40)), [45] * 300, list(range(3, 20))]


# ------------------------------------------------------------------------------------------------- tests


@needs_mooncake
def test_the_store_gives_the_file_spools_features_and_frees_each_entry(master, servers, clients, tmp_path):
    """The same requests through vLLM's file connector and FileSpool, and through the Mooncake connector's put path
    and MooncakeTransport: the same rows, the same next token; every object is removed once read."""
    import asyncio

    from eaglekit.serving.vllm_features import FileSpool

    storage = tmp_path / "spool"
    storage.mkdir()
    by_file = servers("--mode", "file", "--storage", str(storage))
    by_store = servers("--mode", "mooncake", "--master", master.address)
    spool = FileSpool(storage, 20)
    transport = clients.transport(2.0)

    async def capture_all(url, t):
        async with feature_client(vllm_cfg(url, storage), t) as client:
            return await asyncio.gather(*(client.capture(i, ids) for i, ids in enumerate(SAMPLES)))

    from_file = asyncio.run(capture_all(by_file.url, spool))
    from_store = asyncio.run(capture_all(by_store.url, transport))
    for ids, f, m in zip(SAMPLES, from_file, from_store, strict=True):
        assert torch.equal(f.aux, m.aux) and torch.equal(f.last_hidden, m.last_hidden) and f.generated == m.generated
        assert torch.equal(m.aux[:, :HIDDEN], states_of(ids)[:, 0])  # aux layer 2 is the first state, and so on
        packed = -(-(len(ids) * STATES * HIDDEN * 2) // ALIGN) * ALIGN + len(ids) * 8
        assert m.bytes == -(-packed // ALIGN) * ALIGN  # what the store held: the manifest's aligned size
    assert list(storage.iterdir()) == []
    assert clients.inspector().remove_by_regex("^cmpl-.*", True) == 0  # nothing left in the store
    assert transport.held_bytes("p") == 0


@needs_mooncake
def test_the_masters_http_metadata_server_serves_as_well(servers, tmp_path):
    """metadata_server http://host:port/metadata (mooncake_master --enable_http_metadata_server) instead of
    P2PHANDSHAKE: the same request arrives whole and is removed."""
    import asyncio

    from eaglekit.serving.mooncake_transport import MooncakeTransport

    master = Master(tmp_path / "master.log", http_metadata=True)
    transport = MooncakeTransport(settings(master), 20, 2.0)
    try:
        server = servers("--mode", "mooncake", "--master", master.address, "--metadata", master.metadata_server)

        async def one():
            async with feature_client(vllm_cfg(server.url, tmp_path), transport) as client:
                return await client.capture(0, SAMPLES[2])

        captured = asyncio.run(one())
        assert torch.equal(captured.aux[:, HIDDEN : 2 * HIDDEN], states_of(SAMPLES[2])[:, 1])
        assert transport.remove_leftovers("p") == 0  # read and removed
    finally:
        transport.close()
        master.kill()


@needs_mooncake
def test_the_stream_keeps_the_store_within_its_budget(master, servers, clients, tmp_path):
    """The stream through the real FeatureClient and MooncakeTransport: the batches are the data order's features,
    and the store never holds more of the run's objects than extract.stream.spool_gb allows, measured from the
    producer's side (its own client asking the master) and by the transport."""
    from eaglekit.config import parse_config
    from eaglekit.data import shards as sh
    from eaglekit.data.tokens import TokenStore, write_token_store
    from eaglekit.model.target import FinalNorm
    from eaglekit.training import stream as st
    from eaglekit.training.data import RunBatches, collate

    samples = [(f"s{i}", [i + 1] * (20 + 7 * (i % 9)), [1] * (20 + 7 * (i % 9))) for i in range(32)]
    write_token_store(tmp_path / "tokens.safetensors", samples)
    store = TokenStore(tmp_path / "tokens.safetensors")
    cfg = parse_config(
        {
            "run_dir": "run",
            "target": {"model": "unused"},
            "data": {"prompts": "unused.jsonl", "eval_fraction": 0.1},
            "train": {"batch_size": 4, "seed": 3},
        },
        base_dir=tmp_path,
    )
    batches = RunBatches(cfg, store, sh.plan_shards(store.lengths.tolist(), 400), None, 1, 0)
    server = servers("--mode", "mooncake", "--master", master.address, "--delay", "0.03")
    per_token = STATES * HIDDEN * 2 + 8
    longest = int(store.lengths.max())
    limit = 3 * (st.SPOOL_SLACK + longest * per_token)  # three of the longest samples at once
    transport = clients.transport(2.0)
    vcfg = vllm_cfg(server.url, tmp_path)
    stream = st.FeatureStream(batches, lambda: feature_client(vcfg, transport), "bfloat16", limit, per_token, ahead=3)
    norm = FinalNorm(torch.ones(HIDDEN), 1e-6)

    def features_of(i: int) -> sh.Rows:  # the rows extract would store: layers 2, 4, 5 side by side, 8 normed
        states = states_of(store[i][1].tolist())
        return sh.encode(states[:, :3].reshape(len(states), -1), norm(states[:, 3]), "bfloat16")

    try:
        for u in range(batches.per_epoch + 2):  # into the second epoch
            got = stream.get(u)
            entries = batches.entries(u)
            want = collate(store, entries, {store.ids[i]: features_of(i) for i in entries})
            for name in ("input_ids", "loss_mask", "aux", "last_hidden"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (u, name)
    finally:
        stream.close()
    report = stream.report()
    produced_peak = server.status()["peak"]
    assert 0 < produced_peak <= limit
    assert report["spool_peak_bytes"] <= limit and report["spool_reserved_peak_bytes"] <= limit
    in_flight_together = report["spool_reserved_peak_bytes"] > st.SPOOL_SLACK + longest * per_token
    assert in_flight_together


@needs_mooncake
def test_an_error_marker_is_sent_again_and_leftovers_of_the_prefix_are_removed(master, servers, clients, tmp_path):
    """A put that failed on the server (its ``:error`` marker) sends the request again; remove_leftovers takes the
    objects of this run's prefix (a killed attempt's) and leaves another run's."""
    import asyncio

    other = clients.inspector()
    debris = torch.ones(100, dtype=torch.uint8)
    assert other.register_buffer(debris.data_ptr(), 100) == 0
    ours, rank1, other_run = "eks0123456789-r0", "eks0123456789-r1", "eks9876543210-r0"  # as stream.request_prefix
    keys = [f"cmpl-{ours}-17-1-0-deadbeef", f"cmpl-{ours}-18-1-0-deadbeef:error"]
    kept = [f"cmpl-{rank1}-17-1-0-deadbeef", f"cmpl-{other_run}-1-1-0-0"]
    for key in keys + kept:
        assert other.put_from(key, debris.data_ptr(), 100) == 0
    transport = clients.transport(2.0)
    assert transport.remove_leftovers(ours) == 2
    assert other.batch_is_exist(keys + kept) == [0, 0, 1, 1]

    server = servers("--mode", "mooncake", "--master", master.address, "--error-on", "1")

    async def one():
        async with feature_client(vllm_cfg(server.url, tmp_path), transport) as client:
            return await client.capture(0, SAMPLES[1])

    captured = asyncio.run(one())
    assert captured.attempts == 2 and server.status()["requests"] == 2
    assert torch.equal(captured.aux[:, :HIDDEN], states_of(SAMPLES[1])[:, 0])
    assert other.remove_by_regex("^cmpl-p-.*", True) == 0  # the error marker was removed with its request


@needs_mooncake
def test_a_master_that_dies_stops_the_stream_as_every_server_gone_does(master, servers, clients, tmp_path):
    """The master killed mid-run: past extract.vllm.outage_timeout the stream stops with FeatureServersGone, naming
    the master and saying the rerun resumes (no hang, no traceback)."""
    from eaglekit.config import parse_config
    from eaglekit.data import shards as sh
    from eaglekit.data.tokens import TokenStore, write_token_store
    from eaglekit.training import stream as st
    from eaglekit.training.data import RunBatches

    samples = [(f"s{i}", [i + 1] * 12, [1] * 12) for i in range(40)]
    write_token_store(tmp_path / "tokens.safetensors", samples)
    store = TokenStore(tmp_path / "tokens.safetensors")
    cfg = parse_config(
        {
            "run_dir": "run",
            "target": {"model": "unused"},
            "data": {"prompts": "unused.jsonl"},
            "train": {"batch_size": 2},
        },
        base_dir=tmp_path,
    )
    batches = RunBatches(cfg, store, sh.plan_shards(store.lengths.tolist(), 100), None, 1, 0)
    server = servers("--mode", "mooncake", "--master", master.address)
    transport = clients.transport(1.0)
    vcfg = vllm_cfg(server.url, tmp_path, outage_timeout=1.0)
    stream = st.FeatureStream(batches, lambda: feature_client(vcfg, transport), "bfloat16", 10**7, 100, ahead=1)
    try:
        stream.get(0)
        master.kill()
        with pytest.raises(st.FeatureServersGone, match=rf"stream: the Mooncake master at {master.address}") as err:
            for u in range(1, batches.per_epoch):
                stream.get(u)
    finally:
        stream.close()
    assert "has not answered for 1s" in err.value.message
    assert "restart mooncake_master" in (err.value.remedy or "")
    assert "resumes at the last checkpoint" in (err.value.remedy or "")


def test_a_missing_package_is_a_usage_error_that_names_the_install(monkeypatch):
    from eaglekit.config import MooncakeStoreConfig
    from eaglekit.errors import UsageError
    from eaglekit.serving.mooncake_transport import MooncakeTransport

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # `import mooncake.store` raises ImportError
    transport = MooncakeTransport(MooncakeStoreConfig(), 10, 10)
    with pytest.raises(UsageError, match="mooncake package is not installed") as err:
        _ = transport.store  # it connects on first use
    assert "pip install mooncake-transfer-engine-non-cuda" in (err.value.remedy or "")


def test_no_master_at_the_address_is_named_before_setup_waits(tmp_path):
    """Mooncake's setup retries a master that is not there for 90 s; the transport asks the port first."""
    from eaglekit.config import MooncakeStoreConfig
    from eaglekit.serving.mooncake_transport import MooncakeTransport
    from eaglekit.serving.vllm_features import TransportGone

    if MISSING is not None:
        pytest.skip(MISSING)
    port = free_port()
    transport = MooncakeTransport(MooncakeStoreConfig(master_server_address=f"127.0.0.1:{port}"), 10, 10)
    with pytest.raises(TransportGone, match=f"no Mooncake master answers at .* 127.0.0.1:{port}"):
        _ = transport.store


def stream_config(tmp_path: Path, **stream) -> dict:
    from transformers import LlamaConfig

    target = tmp_path / "target"
    LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=128).save_pretrained(
        target
    )
    return {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target)},
        "data": {"prompts": "unused.jsonl"},
        "extract": {
            "mode": "stream",
            "backend": "vllm",
            "vllm": {"servers": ["http://a:8000/v1", "http://b:8000/v1"], "storage_path": str(tmp_path)},
            "stream": stream,
        },
    }


def test_serve_command_prints_the_mooncake_connector_for_each_server(tmp_path):
    """The printed --kv-transfer-config is hs-connectors' connector with the config's store settings; each server's
    shell fills in its own address (MOONCAKE_LOCAL_HOSTNAME)."""
    import shlex

    from eaglekit.config import parse_config
    from eaglekit.stages.extract import vllm_serve_command

    mooncake = {"master_server_address": "10.1.2.3:50051", "protocol": "rdma", "device_name": "mlx5_0"}
    command = vllm_serve_command(parse_config(stream_config(tmp_path, transport="mooncake", mooncake=mooncake)))
    assert command.startswith("vllm serve ")
    flag_line = next(line for line in command.splitlines() if "--kv-transfer-config" in line)
    word = flag_line.split("--kv-transfer-config ", 1)[1].removesuffix(" \\")
    env = {"PATH": os.environ["PATH"], "MOONCAKE_LOCAL_HOSTNAME": "10.1.2.9"}
    printed = subprocess.run(["bash", "-c", f"printf %s {word}"], env=env, capture_output=True, text=True, check=True)
    config = json.loads(printed.stdout)
    assert config == {
        "kv_connector": "MooncakeHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hs_connectors.mooncake_hidden_states_connector",
        "kv_connector_extra_config": {
            "mooncake": {
                "local_hostname": "10.1.2.9",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "10.1.2.3:50051",
                "global_segment_size": 4 << 30,
                "local_buffer_size": 2 << 30,
                "protocol": "rdma",
                "device_name": "mlx5_0",
            }
        },
    }
    speculative = next(line for line in command.splitlines() if "--speculative-config" in line)
    assert json.loads(shlex.split(speculative.removesuffix(" \\"))[1])["method"] == "extract_hidden_states"
    file_command = vllm_serve_command(parse_config(stream_config(tmp_path)))
    assert "ExampleHiddenStatesConnector" in file_command and "Mooncake" not in file_command
    not_yet_served = stream_config(tmp_path)  # the servers' command printed before the config switches to them
    not_yet_served["extract"] = {**not_yet_served["extract"], "mode": "offline", "backend": "hf"}
    assert vllm_serve_command(parse_config(not_yet_served)) == file_command
    without_folder = stream_config(tmp_path, transport="mooncake", mooncake=mooncake)
    del without_folder["extract"]["vllm"]["storage_path"]  # no shared folder with this transport
    assert vllm_serve_command(parse_config(without_folder)) == command


def test_the_mooncake_settings_are_checked_against_the_servers(tmp_path):
    from eaglekit.config import parse_config
    from eaglekit.errors import UsageError
    from eaglekit.resolved import ResolvedRun
    from eaglekit.serving.feature_transports import feature_transport

    too_big = parse_config(
        stream_config(tmp_path, transport="mooncake", spool_gb=8, mooncake={"global_segment_size": 4 << 30})
    )
    with pytest.raises(UsageError, match=r"more than 90% of the Mooncake segments the 2 server\(s\)") as err:
        feature_transport(ResolvedRun(too_big).feature_source)
    assert "lower extract.stream.spool_gb to 7.34" in (err.value.remedy or "")

    cpu = stream_config(tmp_path, transport="mooncake")
    cpu["extract"]["vllm"]["connector"] = "cpu"
    with pytest.raises(UsageError, match="needs GPU servers"):
        feature_transport(ResolvedRun(parse_config(cpu)).feature_source)

    with pytest.raises(UsageError, match="mooncake is set but transport is 'file'"):
        parse_config(stream_config(tmp_path, mooncake={"protocol": "rdma"}))


def test_pre_flight_sizes_the_store_not_a_folder(tmp_path):
    """With the Mooncake transport the storage folder is not read, and the spool is sized against the servers'
    segments."""
    from types import SimpleNamespace

    from eaglekit.config import parse_config
    from eaglekit.preflight.feature_servers import feature_storage, spool_room
    from eaglekit.resolved import ResolvedRun

    def ctx(**stream):
        cfg = stream_config(tmp_path, transport="mooncake", **stream)
        cfg["extract"]["vllm"]["storage_path"] = str(tmp_path / "not-here")
        parsed = parse_config(cfg)
        run = SimpleNamespace(stage_dir=lambda name: tmp_path / name)
        return SimpleNamespace(cfg=parsed, run=run, resolved=ResolvedRun(parsed))

    assert feature_storage(ctx()).status == "skip"
    fits = spool_room(ctx(spool_gb=4))
    assert fits.status == "ok" and "of the servers' Mooncake segments" in fits.detail
    assert spool_room(ctx(spool_gb=8)).status == "fail"


def test_a_reply_that_is_no_mooncake_manifest_is_named():
    from eaglekit.serving.mooncake_transport import parse_manifest
    from eaglekit.serving.vllm_features import ServerSetupError

    with pytest.raises(ServerSetupError, match="writes hidden-states files"):
        parse_manifest({"hidden_states_path": "/hs/cmpl-p-0-1-0-ab.safetensors"}, "http://a/v1")
    with pytest.raises(ServerSetupError, match="without kv_transfer_params.handle"):
        parse_manifest({}, "http://a/v1")
    with pytest.raises(ServerSetupError, match="manifest of version None") as err:  # hs-connectors' layout before 0.9
        parse_manifest({"handle": "cmpl-p-0-1-0-ab"}, "http://a/v1")
    assert "hs-connectors==0.9.0" in (err.value.remedy or "")
    good = packed_manifest("cmpl-p-0-1-0-ab", states_of([1, 2, 3]), torch.tensor([1, 2, 3]))
    entry = parse_manifest(good, "http://a/v1")
    assert entry.size == 256 and entry.tensors["token_ids"][2] == 192  # 3*4*8*2 = 192 bytes, then 24 aligned to 64
    good["tensors"]["token_ids"]["offset"] = 240
    with pytest.raises(ServerSetupError, match="past the object's 256 bytes"):
        parse_manifest(good, "http://a/v1")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2:])
