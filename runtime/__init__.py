"""rdepc.runtime: transports, launch, the module class and the cache.

Importing this package imports neither torch nor triton; its names load on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "KernelError": "rdepc.runtime.records",
    "RDEPModule": "rdepc.runtime.module",
    "load_compiled": "rdepc.runtime.balance",
    "Transport": "rdepc.runtime.transport",
    "Emulated": "rdepc.runtime.transport",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rdepc.runtime' has no attribute {name!r}")


__all__ = sorted(_LAZY)
