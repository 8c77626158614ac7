"""The S3 tier's configuration (``S3Config``): where, how much, and how
each request is made; checked once at the edge."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.configfields import opt, size_field
from kvtier.errors import ConfigError
from kvtier.tiers.collector import CollectedConfig

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX = re.compile(r"^[A-Za-z0-9._\-/]{0,512}$")


_KEYS_FIX = ("write it as scheme://host:port; set the keys in KVTIER_S3_ACCESS_KEY_ID and KVTIER_S3_SECRET_ACCESS_KEY "
             "(or boto3's AWS_* variables, profile, role), or access_key_id/secret_access_key in the config file")


def _secret(doc: str) -> Any:
    # Never shown by repr (so never in logs or error messages that print configs).
    return field(default=None, repr=False, metadata={"doc": doc})


@dataclass(frozen=True)
class S3Config(CollectedConfig):
    # Many processes and nodes read the prefix: recency is the objects'
    # LastModified (and this process's own reads), which only a policy
    # ranked by recency can use.
    stamped_recency: ClassVar[bool] = True

    location: str = opt("", "BUCKET or BUCKET/PREFIX (required; the URL s3://BUCKET/PREFIX fills it)")
    capacity: int = size_field(0, "bytes this tier may hold under its prefix (required)")
    name: str = opt("s3", "tier name in metrics and logs")
    endpoint: str | None = opt(None, "endpoint URL, e.g. http://127.0.0.1:8333 (default: AWS S3)")
    region: str | None = opt(None, "region (default: boto3's configuration chain)")
    access_key_id: str | None = _secret("access key (default: boto3's credential chain: env, profile, instance role)")
    secret_access_key: str | None = _secret("secret key (default: boto3's credential chain); never logged")
    verify_tls: bool = opt(True, "verify the server's TLS certificate (https endpoints)")
    ca_bundle: str = opt("", "CA bundle file for TLS verification (default: certifi's)")
    addressing_style: str = opt("auto", "auto (path style for a custom endpoint, virtual hosts on AWS), path or virtual")
    connect_timeout_s: float = opt(1.0, "connect timeout of one request", gt=0)
    read_timeout_s: float = opt(5.0, "socket read timeout of one request", gt=0)
    max_attempts: int = opt(2, "tries per request, first included (backoff with jitter between them)", ge=1)
    io_threads: int = opt(16, "threads (and connections) of this tier's I/O pool", ge=1)
    read_window_bytes: int = size_field(64 << 20, "bytes of GETs in flight per load")
    create_bucket: bool = opt(False, "create the bucket at start if it does not exist")
    touch_interval_s: float = opt(600.0, "a hit refreshes an object's LastModified (self-copy) once it is older than this", ge=0)
    gc_interval_s: float = opt(300.0, "seconds between automatic collection passes of this instance (0: never)", ge=0)
    gc_lease_s: float = opt(600.0, "a collection pass holds a lease this long: no other instance collects meanwhile", gt=0)
    access_index_entries: int = opt(100_000, "keys whose last access this process remembers for eviction order", ge=1)
    known_ttl_s: float = opt(30.0, "a store skips the existence check for objects this process wrote or read this recently", ge=0)

    @property
    def bucket(self) -> str:
        return self.location.strip("/").partition("/")[0]

    @property
    def prefix(self) -> str:
        """The key prefix, without slashes at either end ('' for none)."""
        return self.location.strip("/").partition("/")[2].strip("/")

    def validate(self, prefix: str = "") -> None:
        if not self.bucket:
            raise ConfigError(f"{prefix}location", "is required", "set BUCKET/PREFIX, e.g. s3://kvcache/prod")
        if not _BUCKET.match(self.bucket):
            raise ConfigError(
                f"{prefix}location", f"bucket name {self.bucket!r} is not valid", "use 3-63 lowercase letters, digits, dots or hyphens"
            )
        # Servers normalise or refuse such prefixes (SeaweedFS answers 400 to
        # every call): refuse them here, with the reason.
        parts = self.prefix.split("/") if self.prefix else []
        if any(p in ("", ".", "..") for p in parts) or not _PREFIX.match(self.prefix):
            raise ConfigError(
                f"{prefix}location", f"key prefix {self.prefix!r} is not valid",
                "use path segments of letters, digits and . _ - (no empty, '.' or '..' segments), e.g. kvcache/prod",
            )
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set", "set how much this tier may hold, e.g. capacity: 1TiB")
        if self.io_threads <= 0:
            raise ConfigError(f"{prefix}io_threads", "must be positive", "use e.g. 16")
        if self.read_window_bytes <= 0:
            raise ConfigError(f"{prefix}read_window_bytes", "must be positive", "use e.g. 64MiB")
        if self.max_attempts < 1:
            raise ConfigError(f"{prefix}max_attempts", "must be at least 1", "use e.g. 2")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError(f"{prefix}read_timeout_s", "timeouts must be positive", "use e.g. connect 1, read 5")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"{prefix}addressing_style", f"unknown style {self.addressing_style!r}", "use auto, path or virtual")
        if self.endpoint and "@" in urlsplit(self.endpoint).netloc:  # the message never repeats it: a secret
            raise ConfigError(f"{prefix}endpoint", "holds credentials (user:secret@ before the host)", _KEYS_FIX)
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                f"{prefix}secret_access_key", "set both access_key_id and secret_access_key, or neither", "or use boto3's credential chain"
            )
        if self.gc_lease_s < 2:
            raise ConfigError(f"{prefix}gc_lease_s", "must be at least 2 seconds", "use e.g. 600")
        self.check_collection(prefix)
