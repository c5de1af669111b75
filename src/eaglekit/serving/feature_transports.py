"""Which transport carries a feature server's hidden states to eaglekit (extract.stream.transport): the file spool
vLLM's connectors write (``vllm_features.FileSpool``), or the Mooncake store (``mooncake_transport``); and the serve
command with that transport's connector. Apart from both, since the Mooncake transport builds on the spool's errors."""

from __future__ import annotations

from pathlib import Path

from eaglekit.errors import UsageError
from eaglekit.resolved import FeatureSource
from eaglekit.serving.mooncake_transport import MooncakeTransport, shell_kv_transfer_config
from eaglekit.serving.vllm_features import FeatureTransport, FileSpool, serve_command


def feature_transport(source: FeatureSource) -> FeatureTransport:
    """The transport extract.stream.transport names for a streamed run (offline extraction reads the file spool)."""
    v = source.servers
    if not source.through_mooncake:
        assert v.storage_path is not None, "parse_config requires extract.vllm.storage_path for the file transport"
        return FileSpool(Path(v.storage_path), v.timeout)
    mooncake_fits(source)
    return MooncakeTransport(source.stream.mooncake, v.timeout, v.outage_timeout)


def feature_serve_command(source: FeatureSource, layer_ids: list[int], max_model_len: int | None) -> str:
    """``serve_command`` for this config's servers, with the connector of its transport."""
    v = source.servers
    kv_transfer = None
    if source.through_mooncake:
        mooncake_fits(source)
        kv_transfer = shell_kv_transfer_config(source.stream.mooncake)
    return serve_command(
        source.target_model,
        layer_ids,
        v.storage_path,
        v.connector,
        source.served_model,
        max_model_len,
        v.gpu_memory_utilization,
        kv_transfer=kv_transfer,
    )


def mooncake_fits(source: FeatureSource) -> None:
    """The Mooncake transport's settings against the servers': GPU servers, and a budget the segments hold."""
    v, stream = source.servers, source.stream
    if v.connector == "cpu":
        raise UsageError(
            "extract.stream.transport mooncake needs GPU servers: speculators' MooncakeHiddenStatesConnector copies "
            "the states out on an accelerator stream (torch.accelerator), which vLLM's CPU build has not",
            "set extract.vllm.connector: stock and serve on GPUs, or extract.stream.transport: file",
        )
    segments = len(v.servers) * stream.mooncake.global_segment_size
    if source.spool_bytes > 0.9 * segments:
        raise UsageError(
            f"extract.stream.spool_gb ({stream.spool_gb:g} GB) is more than 90% of the Mooncake segments the "
            f"{len(v.servers)} server(s) lend the store ({segments / 1e9:.2f} GB: extract.stream.mooncake."
            "global_segment_size each); above 90% the master evicts entries not yet read",
            f"lower extract.stream.spool_gb to {0.9 * segments / 1e9 * 0.95:.2f} or raise "
            "extract.stream.mooncake.global_segment_size",
        )
