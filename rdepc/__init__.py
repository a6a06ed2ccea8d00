"""rdepc: a compiler for sparse Mixture-of-Experts layers executed the RDEP way.

``rdepc.load(path)`` checks a ``.rdep`` spec and returns a layer object (``.generated``,
``.source`` and ``.module()`` compile it); ``rdepc.parse`` gives the syntax tree;
``rdepc.RDEPMoE`` is a drop-in MoE block running the compiled kernels. Importing rdepc
imports neither torch nor triton.
"""

from rdepc.api import Layer, UsageError, load, parse
from rdepc.diagnostics import SpecError
from rdepc.version import __version__


def __getattr__(name: str):
    """``rdepc.RDEPMoE`` (a torch.nn.Module) is imported on first use, with torch."""
    if name == "RDEPMoE":
        from rdepc.moe import RDEPMoE

        return RDEPMoE
    raise AttributeError(f"module 'rdepc' has no attribute {name!r}")


__all__ = ["Layer", "RDEPMoE", "SpecError", "UsageError", "__version__", "load", "parse"]
