"""The Redis/Valkey tier (``tier.RedisTier``, kind ``redis``) and its parts:
``config`` (``RedisConfig``), ``scripts`` (the Lua scripts of its byte
budget), ``readpool`` (GETs received straight into pooled buffers on
sockets of its own), ``tls`` (one TLS set-up for both kinds of
connection). Importing this package imports no redis-py."""
