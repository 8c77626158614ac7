"""The Redis tier's configuration (``RedisConfig``): which servers, how
much, TLS and timeouts; checked once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvtier.configfields import opt, size_field
from kvtier.errors import ConfigError
from kvtier.tiers.redis import tls as redis_tls


@dataclass(frozen=True)
class RedisConfig:
    address: str = opt("", "host:port of the server, or of any cluster node (comma-separated for several)")
    capacity: int = size_field(0, "bytes kvtier may keep under key_prefix (required; enforced by kvtier itself)")
    name: str = opt("redis", "tier name in metrics and logs")
    db: int = opt(0, "database number (0 on a cluster)", ge=0)
    username: str = opt("", "ACL user name (empty: default user)")
    password: str = field(default="", repr=False, metadata={"doc": "password (never logged; prefer KVTIER_* env or a file readable only by kvtier)"})
    tls: bool = opt(False, "connect with TLS (the URL scheme rediss:// sets it)")
    tls_ca_file: str = opt("", "CA bundle (PEM) that signs the server certificate (empty: system store)")
    tls_cert_file: str = opt("", "client certificate (PEM) presented to the server (a Redis with tls-auth-clients yes needs one)")
    tls_key_file: str = opt("", "private key (PEM, unencrypted) of tls_cert_file (empty: in tls_cert_file)")
    tls_check_hostname: bool = opt(True, "the server certificate must name the host in address (its IP SANs for an IP address)")
    cluster: bool = opt(False, "talk to a Redis Cluster (objects spread over all slots)")
    key_prefix: str = opt("kvtier:v1:", "prefix of every key kvtier writes; one capacity budget per prefix")
    # Optional[...], not "float | None": configfields._coerce recognises typing.Union only.
    ttl_s: Optional[float] = opt(None, "expire objects not read for this long (optional; reads refresh it)")
    socket_timeout_s: float = opt(1.0, "timeout of every command", gt=0)
    connect_timeout_s: float = opt(1.0, "timeout of connecting", gt=0)
    pool_size: int = opt(32, "connections per server (at least io_threads + 4)", ge=1)
    io_threads: int = opt(16, "threads of this tier's I/O pool", ge=1)
    read_window_bytes: int = size_field(64 << 20, "bytes of reads in flight per load")

    def validate(self, prefix: str = "") -> None:
        if not self.address:
            raise ConfigError(f"{prefix}address", "is required", "set it, e.g. redis://10.0.0.5:6379?capacity=64GiB")
        if "@" in self.address or "/" in self.address:
            raise ConfigError(f"{prefix}address", "must be host:port only (no user:password@, no scheme or path)",
                              "set the password in KVTIER_REDIS_PASSWORD (or password: in the config file), never in the address")
        for i, node in enumerate(self.nodes()):
            if node is None:
                raise ConfigError(f"{prefix}address", f"cannot read node {i} as host:port", "write e.g. 10.0.0.5:6379")
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set", "set how much kvtier may keep in Redis, e.g. capacity: 64GiB")
        if self.cluster and self.db != 0:
            raise ConfigError(f"{prefix}db", "a cluster has only database 0", "remove db or set it to 0")
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ConfigError(f"{prefix}key_prefix", "must be non-empty and hold no braces (hash tags)", "use e.g. kvtier:v1:")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}", "must be positive", "use e.g. 1.0")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError(f"{prefix}ttl_s", "must be positive", "remove it or set seconds, e.g. 86400")
        if self.io_threads <= 0:
            raise ConfigError(f"{prefix}io_threads", "must be positive", "use e.g. 16")
        if self.pool_size < self.io_threads + 4:
            raise ConfigError(f"{prefix}pool_size", f"must be at least io_threads + 4 ({self.io_threads + 4})", "raise pool_size")
        if self.read_window_bytes <= 0:
            raise ConfigError(f"{prefix}read_window_bytes", "must be positive", "use e.g. 64MiB")
        redis_tls.check(self, prefix)

    def nodes(self) -> list[tuple[str, int] | None]:
        out: list[tuple[str, int] | None] = []
        for part in self.address.split(","):
            host, _, port = part.strip().rpartition(":")
            host = host.strip("[]")
            out.append((host, int(port)) if host and port.isdigit() else None)
        return out
