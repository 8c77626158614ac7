"""What benchmarks and tests ask of kvtier inside vLLM's workers.

vLLM runs its workers in processes of their own (tensor parallel, its
default multiprocess mode), out of reach of the process that drives the
engine. ``KVTierWorkerExtension`` is given to vLLM as
``worker_extension_cls``: vLLM mixes it into every worker, and
``LLM.collective_rpc("kvtier_flush")`` and the like run it on each rank.
Only benchmark control goes this way (drain saves, empty tiers, drop the
page cache), never KV.
"""

from __future__ import annotations

WORKER_EXTENSION = "kvtier.bench.worker_ext.KVTierWorkerExtension"


def _connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn if hasattr(conn, "flush_saves") else None


class KVTierWorkerExtension:
    def kvtier_flush(self, timeout: float = 60.0) -> bool:
        conn = _connector()
        return conn is None or conn.flush_saves(timeout)

    def kvtier_clear(self, names: list[str]) -> int:
        conn = _connector()
        return 0 if conn is None else conn.clear_tiers(names)

    def kvtier_drop_page_cache(self) -> int:
        conn = _connector()
        return 0 if conn is None else conn.drop_page_cache()
