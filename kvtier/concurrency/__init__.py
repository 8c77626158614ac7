"""Where kvtier's work runs, beneath both the store and the tiers:
``executor`` (a tier's prioritised pool, byte windows, the threads'
placement) and ``breaker`` (a circuit breaker per tier). Imports nothing
else of kvtier."""
