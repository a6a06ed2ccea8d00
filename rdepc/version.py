"""The version of rdepc, stamped into every kernel contract and cache key."""

__version__ = "0.1.0"
