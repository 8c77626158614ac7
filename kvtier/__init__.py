"""kvtier: a tiered KV cache (host DRAM, local disk, shared storage) for LLM
inference engines.

Importing kvtier imports no storage client, no engine and no CUDA.
"""

from kvtier.version import FORMAT_VERSION, __version__

__all__ = ["__version__", "FORMAT_VERSION"]
