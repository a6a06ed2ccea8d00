"""A call's arguments, checked on the host before anything launches: every tensor dense and
of the shape, dtype and device the layer takes (one process: every rank's tokens and every
expert's weights; per rank: its own), and the tokens each rank brings (``tokens=``, the
padding mask). What needs the data — expert ids in range, distinct top-K, finite gates — the
kernel checks (``rdepc.runtime.records``)."""

from __future__ import annotations

import torch

from rdepc.diagnostics import layer_prefix
from rdepc.ir.contract import KernelContract


def dense(name: str, arg: str, t) -> None:
    """TypeError unless ``t`` is an ordinary (strided, not nested) tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"{name}: {arg} must be a dense (strided) tensor, got a {layout} one")


def check_inputs(
    p: KernelContract,
    name: str,
    own: int | None,
    dtype,
    device,
    x,
    topk_ids,
    topk_weights,
    w_gate,
    w_up,
    w_down,
    biases: dict | None = None,
) -> None:
    """A ValueError or TypeError, in one line starting with ``name``, unless the call's
    tensors are what the layer takes: ``own`` is a per-rank module's number of experts (its
    tokens [T', H] and its experts' weights), None in one process ([W, T', H], every expert).
    ``biases``: the expert biases by name (b_gate, b_up, b_down; each None when not given)."""
    W, T, H, F, E, K = p.W, p.T, p.H, p.F, p.E, p.K
    for arg, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_up", w_up)):
        dense(name, arg, t)
    if own is not None:
        lead, lead_s, n_exp, E_s = (), "", own, f"E_loc={own}"
    else:
        lead, lead_s, n_exp, E_s = (W,), "W, ", E, f"E={E}"
    if x.dim() != len(lead) + 2 or tuple(x.shape[: len(lead)]) != lead or x.shape[-1] != H:
        raise ValueError(f"{name}: x must be [{lead_s.replace('W', f'W={W}')}T', H={H}], got {tuple(x.shape)}")
    Tn = x.shape[-2]
    if Tn > T:
        raise ValueError(f"{name}: x has T'={Tn} tokens per rank, more than the layer's bound T={T}")
    want = (*lead, Tn, K)
    if tuple(topk_ids.shape) != want:
        raise ValueError(f"{name}: topk_ids must be [{lead_s}T', K] = {list(want)}, got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != want:
        raise ValueError(
            f"{name}: topk_weights must be [{lead_s}T', K] = {list(want)}, got {tuple(topk_weights.shape)}"
        )
    if x.dtype != dtype:
        raise TypeError(f"{name}: x must be {dtype} (the spec's dtype {p.dtype}), got {x.dtype}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: topk_ids must be int64 (or int32), got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"{name}: topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    experts = {"w_up": (w_up, (n_exp, H, F)), "w_down": (w_down, (n_exp, F, H))}
    if p.gated:
        if w_gate is None:
            raise ValueError(f"{name}: {p.act} experts are gated: w_gate [{E_s}, H={H}, F={F}] is required")
        experts["w_gate"] = (w_gate, (n_exp, H, F))
    elif w_gate is not None:
        raise ValueError(f"{name}: {p.act} experts are not gated: pass w_gate=None")
    given = {k: v for k, v in (biases or {}).items() if v is not None}
    if p.bias:
        want = {"b_up": (n_exp, F), "b_down": (n_exp, H)} | ({"b_gate": (n_exp, F)} if p.gated else {})
        missing = [f"{k} {list(want[k])}" for k in want if k not in given]
        if missing:
            raise ValueError(f"{name}: the experts have biases ('expert ..., bias'): {', '.join(missing)} required")
        extra = sorted(set(given) - set(want))
        if extra:
            raise ValueError(f"{name}: {p.act} experts are not gated: pass {extra[0]}=None")
        experts |= {k: (given[k], want[k]) for k in want}
    elif given:
        raise ValueError(f"{name}: the spec's experts have no biases, but {', '.join(sorted(given))} was given")
    for arg, (w, shape) in experts.items():
        dense(name, arg, w)
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: {arg} must be {list(shape)}, got {tuple(w.shape)}")
        if w.dtype != dtype:
            raise TypeError(f"{name}: {arg} must be {dtype} (the spec's dtype {p.dtype}), got {w.dtype}")
    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights}
    tensors.update({k: v for k, (v, _) in experts.items()})
    for arg, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name}: {arg} is on {t.device}, the module on {device}")
    # Expert ids in range, distinct top-K and finite gates need the data: the kernel checks
    # them (validate) and the host raises from its record, with no sync in the call. Any
    # strides are accepted: the module makes the tensors contiguous (a copy when they are not).


def brought_tokens(
    p: KernelContract, tokens, Tn: int, per_rank: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tokens`` (``RDEPModule.forward``) checked: the tokens each rank brings as the kernel
    reads them ([W]; a per-rank module: its own, [1]) and the mask of those tokens among the
    T' = ``Tn`` (bool [W, Tn]; None when every token is brought)."""
    ranks = 1 if per_rank else p.W
    if tokens is None:
        return torch.full((ranks,), Tn, dtype=torch.int64, device=device), None
    name = layer_prefix(p.layer)
    if per_rank:
        raise ValueError(f"{name}: tokens= is for the one-process backend; each rank passes its own T' tokens")
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu" or tokens.dtype.is_floating_point or tokens.dim() != 1:
            raise ValueError(f"{name}: tokens must be W={ranks} ints on the host (a list or a CPU tensor)")
        tokens = tokens.tolist()
    counts = list(tokens)
    if len(counts) != ranks or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= Tn for n in counts):
        raise ValueError(f"{name}: tokens must give each of the W={ranks} ranks a count in [0, T'={Tn}], got {counts}")
    return token_mask(counts, Tn, device)


def token_mask(counts: list[int], Tn: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts`` on ``device`` (int64 [W]) and the mask of the tokens they cover (bool [W, Tn]),
    without the host waiting for the device (a pinned copy, queued)."""
    if torch.compiler.is_compiling():  # a constant of the graph: no pinned staging to trace
        brought = torch.tensor(counts, dtype=torch.int64, device=device)
    else:
        host = torch.tensor(counts, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        brought = host.to(device, non_blocking=True)
    return brought, torch.arange(Tn, device=device)[None, :] < brought[:, None]


__all__ = ["brought_tokens", "check_inputs", "dense", "token_mask"]
