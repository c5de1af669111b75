"""``extract``: where the target's hidden states (the drafter's features) come from: the target in train
(online), shards on disk (offline), or vLLM servers as train goes (stream, over files or a Mooncake store)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from eaglekit.config.base import DtypeAlias, Section, ServerPoolConfig
from eaglekit.config.paths import PATH
from eaglekit.errors import UsageError


class VllmFeaturesConfig(ServerPoolConfig):
    """extract.backend vllm: running vLLM servers started with the extract_hidden_states method
    (`eaglekit serve-command CONFIG` prints the command)."""

    model: str | None = Field(None, description="served model id (default: the target path, vLLM's default id)")
    storage_path: Annotated[str | None, PATH] = Field(
        None,
        min_length=1,
        description="the servers' shared_storage_path, as this machine sees it (a shared folder: the servers write "
        "each request's hidden states there); required by the file transport (extract.mode offline, and stream with "
        "extract.stream.transport file), unused with transport mooncake",
    )
    connector: Literal["stock", "cpu"] = Field(
        "stock",
        description="stock: vLLM's ExampleHiddenStatesConnector (GPUs); cpu: eaglekit's CPU-capable "
        "subclass (vLLM's CPU build), loaded from eaglekit's vllm_plugin folder",
    )
    # each request carries a whole sample's hidden states to disk: fewer in flight than generate's replies
    concurrency: int = Field(8, ge=1, description="in-flight requests per server")
    timeout: float = Field(600.0, gt=0, description="seconds per request, and per wait for its file")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's --gpu-memory-utilization for the servers (`serve-command` prints it): the share of each "
        "of its GPUs' memory a server takes (weights, KV cache, activations); unset: vLLM's default (0.92 in vLLM 0.32)",
    )
    shares_trainer_gpus: bool = Field(
        False,
        description="extract.mode stream: the servers run on the GPUs train uses (one node): plan and train's "
        "pre-flight add their gpu_memory_utilization × the GPU's memory to the drafter's step memory per GPU",
    )


class MooncakeStoreConfig(Section):
    """extract.stream.transport mooncake: the Mooncake store speculators' MooncakeHiddenStatesConnector (hs-connectors)
    puts each request's hidden states into. The keys are that connector's ``kv_connector_extra_config.mooncake``
    keys, with its defaults; `eaglekit serve-command CONFIG` prints them for the servers."""

    master_server_address: str = Field("127.0.0.1:50051", min_length=1, description="the mooncake_master, host:port")
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        min_length=1,
        description="P2PHANDSHAKE (no metadata server), or http://host:port/metadata (mooncake_master "
        "--enable_http_metadata_server), or an etcd address",
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device(s), e.g. mlx5_0 or mlx5_0,mlx5_1; empty: Mooncake chooses")
    local_hostname: str | None = Field(
        None,
        description="this machine's address as the servers reach it (default: $MOONCAKE_LOCAL_HOSTNAME, else the "
        "host name's address, as hs-connectors does); each server sets its own in $MOONCAKE_LOCAL_HOSTNAME",
    )
    global_segment_size: int = Field(
        4 << 30,
        ge=1 << 20,
        description="bytes of memory each server lends the store (where the hidden states wait until read); "
        "extract.stream.spool_gb must fit in 90% of the servers' segments together (the master evicts above that)",
    )
    local_buffer_size: int = Field(2 << 30, ge=1 << 20, description="each server's Mooncake staging buffer, bytes")


class FeatureStreamConfig(Section):
    """extract.mode stream: train asks the vLLM feature servers (extract.vllm) for each upcoming micro-batch's
    hidden states instead of reading shards; nothing but the servers' in-flight request files is stored."""

    transport: Literal["file", "mooncake"] = Field(
        "file",
        description="how the hidden states travel from the servers: file: vLLM's hidden-states connector writes a "
        "file per request to extract.vllm.storage_path; mooncake: speculators' MooncakeHiddenStatesConnector puts "
        "them into a Mooncake store (extract.stream.mooncake), over TCP or RDMA, no shared folder",
    )
    mooncake: MooncakeStoreConfig = Field(default_factory=MooncakeStoreConfig)

    spool_gb: float = Field(
        4.0,
        gt=0,
        description="GB the servers' hidden-states files may take in extract.vllm.storage_path at once (with "
        "transport mooncake: the entries in the Mooncake store): requests wait while those in flight would pass it",
    )
    ahead: int = Field(4, ge=1, description="micro-batches assembled ahead of the optimizer (held in memory)")
    cache_gb: float = Field(
        0.0,
        ge=0,
        description="epochs past the first: 0 requests every sample's features again; > 0 keeps up to this many GB "
        "of encoded features in memory and reuses them (the rest is requested again); the held-out rows are kept "
        "between evaluations up to max(cache_gb, 1 GB), else requested again at each evaluation",
    )

    @model_validator(mode="after")
    def _mooncake_only_with_its_transport(self) -> FeatureStreamConfig:
        # a dump (RUN_DIR/config.yaml) holds the default section: only settings that would do something are refused
        if self.transport != "mooncake" and self.mooncake != MooncakeStoreConfig():
            raise ValueError("mooncake is set but transport is 'file': set transport: mooncake, or remove mooncake")
        return self


class ExtractConfig(Section):
    mode: Literal["online", "offline", "stream"] = Field(
        "online",
        description="online: the target runs inside train; offline: extract stores every sample's features on disk "
        "first; stream: train requests them from the vLLM servers (extract.backend vllm) as it goes, storing only a "
        "bounded spool (extract.stream)",
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="hf: the target in this process (transformers); vllm: hidden states from vLLM servers"
    )
    dtype: Annotated[Literal["bfloat16", "fp8", "float16", "float32"], DtypeAlias] = Field(
        "bfloat16",
        description="feature storage: fp8 is e4m3 with a power-of-two scale per token and state (half of bf16)",
    )
    shard_tokens: int = Field(1_000_000, ge=1, description="tokens per feature shard")
    batch_tokens: int = Field(8192, ge=1)
    writer_queue: int = Field(4, ge=1, description="batches waiting for the background shard writer at most")
    vllm: VllmFeaturesConfig | None = None
    stream: FeatureStreamConfig = Field(default_factory=FeatureStreamConfig)

    @property
    def offline(self) -> bool:
        """Features are extracted to disk first (the extract stage runs); online, train runs the target itself."""
        return self.mode == "offline"

    @property
    def online(self) -> bool:
        """The target runs inside train (neither shards nor servers)."""
        return self.mode == "online"

    @property
    def streamed(self) -> bool:
        """train requests the features from the vLLM servers as it goes (no extract stage, no shards)."""
        return self.mode == "stream"

    @property
    def through_mooncake(self) -> bool:
        """A stream whose hidden states go through the Mooncake store; every other way the vLLM servers hand them
        over (offline extraction, a stream with transport file) is a file in extract.vllm.storage_path."""
        return self.streamed and self.stream.transport == "mooncake"

    def check_runnable(self, source: str) -> None:
        """Refuses, naming ``source`` (the config file), a combination of extract's keys that cannot run though each
        key is valid alone: where the features come from, the vLLM servers, how the hidden states reach this machine."""
        if self.streamed and self.backend != "vllm":
            raise UsageError(
                f"{source}: extract.mode is 'stream' but extract.backend is '{self.backend}'",
                "set extract.backend: vllm and extract.vllm (the features stream from vLLM servers), or extract.mode: "
                "online to run the target inside train",
            )
        if self.backend == "vllm":
            if self.online:
                raise UsageError(
                    f"{source}: extract.backend is 'vllm' but extract.mode is 'online'",
                    "set extract.mode: offline (vLLM's features stored on disk first) or stream (requested as training "
                    "goes); online training runs the target here",
                )
            if self.vllm is None or not self.vllm.servers:
                raise UsageError(
                    f"{source}: extract.backend is 'vllm' but extract.vllm.servers is empty",
                    "add extract.vllm: {servers: [http://host:8000/v1], storage_path: /shared/hidden-states}",
                )
            if self.vllm.storage_path is None and not self.through_mooncake:
                reader = "train's stream (extract.stream.transport file)" if self.streamed else "offline extraction"
                raise UsageError(
                    f"{source}: extract.vllm.storage_path is not set: {reader} reads each request's hidden states from "
                    "the file the servers write there",
                    "set extract.vllm.storage_path to the servers' shared_storage_path as this machine sees it (a "
                    "folder both reach)"
                    + (", or extract.stream.transport: mooncake (no shared folder)" if self.streamed else ""),
                )
            if self.vllm.shares_trainer_gpus and not self.streamed:
                raise UsageError(
                    f"{source}: extract.vllm.shares_trainer_gpus is set but extract.mode is '{self.mode}': the "
                    "servers only share the trainer's GPUs while train streams from them",
                    "remove extract.vllm.shares_trainer_gpus (offline extraction runs before train, not beside it), or "
                    "set extract.mode: stream",
                )
