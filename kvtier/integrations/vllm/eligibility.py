"""Which vLLM requests kvtier may serve: plain text requests, and of those
not the ones that must compute their whole prompt.

Threads: none of its own; pure functions of a request's attributes.
"""

from __future__ import annotations


def must_compute_prompt(request) -> bool:
    """A request whose every prompt token must be computed, so no cached
    prefix may be claimed for it: prompt logprobs need each prompt position's
    logits. vLLM 0.31+ marks it (``skip_reading_prefix_cache``, set from the
    sampling or pooling parameters) and skips connectors for it itself;
    vLLM 0.30 has neither, so kvtier asks the sampling parameters."""
    skip = getattr(request, "skip_reading_prefix_cache", None)
    if skip is not None:
        return bool(skip)
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, "prompt_logprobs", None) is not None


def cacheable(request) -> bool:
    """Token ids alone identify the KV only for plain text requests: images
    (placeholder tokens), LoRA adapters and prompt embeddings change KV
    without changing token ids, so such requests bypass kvtier entirely."""
    return not (
        getattr(request, "mm_features", None)
        or getattr(request, "lora_request", None)
        or getattr(request, "prompt_embeds", None) is not None
    )
