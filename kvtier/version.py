"""Versions that appear in stored data and in the package metadata."""

__version__ = "0.1.0"

# Bumped whenever the chunk object layout or the key derivation changes.
# It is part of every namespace digest, so old objects simply stop matching.
FORMAT_VERSION = 2
