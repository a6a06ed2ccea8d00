"""Text helpers of the templates: fp32 narrowed to a kernel dtype, and calls laid out as
ruff formats them."""

from __future__ import annotations

from rdepc.ir.contract import KernelContract

NARROW = '''@triton.jit
def narrow(x, dtype: tl.constexpr, CAST_F32: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even. The interpreter truncates fp32 to
    bf16, so under it (CAST_F32) the rounding is done on the bits first."""
    if CAST_F32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
'''


def narrowed(p: KernelContract, expr: str, dtype: str) -> str:
    """``expr`` (fp32) converted to the constexpr dtype ``dtype`` ("DTYPE" or "DISPATCH_DTYPE")."""
    if (p.dtype if dtype == "DTYPE" else p.dispatch) == "bf16":
        return f"narrow({expr}, {dtype}, CAST_F32)"
    return f"{expr}.to({dtype})" if expr.replace(".", "_").isidentifier() else f"({expr}).to({dtype})"


def call(head: str, args: list[str], indent: int) -> str:
    """``head(args)`` at ``indent`` spaces, laid out as ruff formats it: on one line if it
    fits in 120 columns, else one argument per line."""
    pad = " " * indent
    line = f"{pad}{head}({', '.join(args)})"
    if len(line) <= 120:
        return line + "\n"
    inner = "".join(f"{pad}    {a},\n" for a in args)
    return f"{pad}{head}(\n{inner}{pad})\n"
