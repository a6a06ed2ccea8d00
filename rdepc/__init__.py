"""rdepc: a compiler for sparse Mixture-of-Experts layers executed the RDEP way.

``rdepc.load(path)`` checks a ``.rdep`` spec and returns a layer object; ``rdepc.parse``
gives the syntax tree. Importing rdepc imports neither torch nor triton.
"""

__version__ = "0.1.0"

from rdepc.api import Layer, UsageError, load, parse
from rdepc.diagnostics import SpecError

__all__ = ["Layer", "SpecError", "UsageError", "__version__", "load", "parse"]
