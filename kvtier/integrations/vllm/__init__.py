"""kvtier as a vLLM V1 KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"config": "/etc/kvtier.yaml"}}'

Supported vLLM: 0.30 to 0.33 (docs/vllm.md says how each was checked).

The connector is imported when vLLM asks for it: the rest of this package
(``layout``, for instance, which the GPU check runs with torch alone)
imports without vLLM installed.
"""

__all__ = ["KVTierConnector"]


def __getattr__(name: str):
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
