"""A vLLM v1 KV connector backed by kvstore. Importable only where vLLM is installed.

Run vLLM with it (one cache service of the store must run on the machine)::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.engines.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "demo", "page_tokens": 64}
    }'

Extra config: ``store`` (required), ``server`` (when several services of the
store run here), ``mass_home``, ``page_tokens`` (a multiple of the block size;
default 4 blocks), ``model_id`` (default: the model name and revision),
``tenant``.

Loads are synchronous (in ``start_load_kv``); pages are saved after the
forward pass that completes them (``wait_for_save``). Every block that could
not be loaded is reported through ``get_block_ids_with_load_errors`` and
recomputed by vLLM. The logic lives in ``vllm_mapping.py`` and is tested
there without vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole)

from ..client import KVCacheClient
from ..keys import KeyNamespace
from .vllm_mapping import LAYOUT, SchedulerSide, StepPlan, WorkerSide


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, sent to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector interface over ``kvstore`` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        if "store" not in extra:
            raise ValueError("kv_connector_extra_config needs 'store' (the kvstore store name)")
        self.block_size = int(vllm_config.cache_config.block_size)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        page_tokens = int(extra.get("page_tokens", 4 * self.block_size))
        model_id = str(extra.get("model_id") or f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}")
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        else:
            tp_rank = 0  # the scheduler asks with rank 0's keys; every rank saves the same pages
        self.ns = KeyNamespace(model_id, str(mc.dtype).removeprefix("torch."), mc.get_num_layers(pc),
                               mc.get_num_kv_heads(pc), mc.get_head_size(), page_tokens, tp_rank=tp_rank,
                               tp_size=pc.tensor_parallel_size, tenant=str(extra.get("tenant", "")), layout=LAYOUT)
        self.client = KVCacheClient.connect(extra["store"], server=extra.get("server"), home=extra.get("mass_home"))
        self.scheduler = SchedulerSide(self.ns, self.block_size, self.client.lookup)
        self.worker: WorkerSide | None = None
        self._load_errors: set[int] = set()

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.scheduler.num_new_matched_tokens(request.request_id, request.prompt_token_ids, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        for req in scheduler_output.scheduled_new_reqs:
            n = scheduler_output.num_scheduled_tokens.get(req.req_id, 0)
            self.scheduler.prompt_progress(req.req_id, req.prompt_token_ids, req.block_ids[0],
                                           req.num_computed_tokens + n)
        return KVStoreConnectorMetadata(self.scheduler.build_plan())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request.request_id)
        return False, None

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker = WorkerSide(self.client, self.ns, self.block_size, kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self.worker is not None
        for t in meta.plan.loads:
            self._load_errors |= self.worker.load(t)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole pages are saved in wait_for_save, after every layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self.worker is not None
        for t in meta.plan.saves:
            self.worker.save(t)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.client.close()
