"""Cache-aware routing from the engines' KV events.

``subscriber`` reads one engine's ZMQ stream of vLLM ``KVEventBatch``es,
``index`` keeps which instance holds which block on which medium and
predicts each instance's prefix hit for a prompt, ``router`` picks the
instance, and ``live`` ties the three together for a client that sends
requests to several servers (``kvtier.bench.endpoint``'s ``events``
routing). Importing this package imports neither zmq nor vLLM; the
subscriber does when it starts.
"""
