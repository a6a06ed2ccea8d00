"""Expert parallelism in torch.distributed's terms: which parameters are experts, and data
parallelism (DDP, FSDP2) over the rest of a model.

On a per-rank backend (``emulated-mp``, ``nvshmem``: one process per rank, started by
``torchrun --nproc-per-node W``) each rank's :class:`rdepc.RDEPMoE` holds only its own
experts — ``w_gate_up`` (gated experts) or ``w_up``, and ``w_down``, and their biases if
any — while its router and
shared experts, like the rest of the model, are replicated. Data parallelism over such a
model must

* leave the expert parameters alone: never broadcast, average or shard them. Plain DDP
  copies rank 0's experts over every other rank's at construction, then averages the
  gradients of different experts; FSDP2 shards each rank's experts as if every rank held
  the same tensor;
* average the replicated parameters' gradients over the ranks, as DDP and FSDP2 do: the
  objective is then the mean of the ranks' losses;
* divide the expert gradients by the world size W. rdepc's backward gives each owner the
  sum, over every rank's tokens routed to its experts, of their contributions to their own
  rank's loss: the gradient of the *sum* of the ranks' losses, W times that of their mean.

:func:`data_parallel` (DDP) and :func:`fully_shard` (FSDP2) do all three::

    model = rdepc.distributed.data_parallel(model)  # instead of DistributedDataParallel(model)
    rdepc.distributed.fully_shard(model)             # instead of fully_shard(model)

By hand: put the names of :func:`expert_parameters` in DDP's ignore list
(``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``; a parameter of
the wrapped module itself is listed twice, as ``name`` and ``.name``, the name DDP's reducer
looks up), or pass the parameters as ``fully_shard(..., ignored_params=...)``, and call
:func:`scale_expert_grads`.

Every RDEPMoE marks its expert parameters (``p._rdepc_expert = True``, :func:`mark_experts`).
On a per-rank backend it also installs a guard, once per process: the first forward of a
``DistributedDataParallel`` or FSDP2 module that synchronises or shards per-rank experts,
or leaves their gradients unscaled, raises :class:`rdepc.UsageError` in one line, before
any step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from rdepc.checkpoint import EXPERT_PARAMS
from rdepc.diagnostics import UsageError, layer_prefix
from rdepc.runtime.transport import get as get_transport

# An RDEPMoE's expert parameters, by attribute name (a gated expert's w_up is a view of w_gate_up),
# expert biases included.
EXPERT_WEIGHTS = EXPERT_PARAMS
FIX_DDP = "rdepc.distributed.data_parallel(model)"
FIX_FSDP = "shard it with rdepc.distributed.fully_shard(module), which leaves them out (ignored_params)"

_scaled = WeakIdKeyDictionary()  # parameter -> (world, its hook's handle); by identity, as tensors compare elementwise
_guard = None  # the global forward pre-hook's handle, once installed
_wrappers: tuple = ()  # the module types the guard checks
_checked = "_rdepc_checked"  # set in a wrapper's __dict__ once it passed the guard


def is_block(m) -> bool:
    """Whether ``m`` is an :class:`rdepc.RDEPMoE` (by its class's ``rdepc_block`` flag: this
    module is imported by rdepc.moe, and so cannot import it)."""
    return getattr(type(m), "rdepc_block", False) is True


def _experts_of(moe: nn.Module) -> list[nn.Parameter]:
    # by name, not by the mark: FSDP2 replaces a parameter it shards with a new one
    return [p for name in EXPERT_WEIGHTS if (p := moe._parameters.get(name)) is not None]


def is_per_rank(m: nn.Module) -> bool:
    """Whether ``m`` is an RDEPMoE on a per-rank backend (each rank holds its own experts)."""
    # by its backend, not its kernels: a block built on the meta device has none yet
    return is_block(m) and get_transport(m.backend).per_rank


def mark_experts(moe: nn.Module) -> None:
    """Mark ``moe``'s expert parameters (``p._rdepc_expert = True``) and, on a per-rank
    backend, install the guard against data parallelism over them (once per process).
    RDEPMoE's constructor calls it."""
    for p in _experts_of(moe):
        p._rdepc_expert = True
    if is_per_rank(moe):
        _install_guard()


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an RDEPMoE's expert parameter (marked by :func:`mark_experts`)."""
    return getattr(p, "_rdepc_expert", False) is True


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs of every RDEPMoE's expert parameters in ``model`` (names
    as ``model.named_parameters()`` gives them), whatever the backend."""
    mine = {id(p) for m in model.modules() if is_block(m) for p in _experts_of(m)}
    return [(n, p) for n, p in model.named_parameters() if id(p) in mine]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every other (name, parameter) pair of ``model``: routers, shared experts, the rest."""
    mine = {id(p) for _, p in expert_parameters(model)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in mine]


def _rank_experts(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The expert parameters of the per-rank RDEPMoEs in ``model`` (one-process backends'
    experts are whole replicas: data parallelism treats them like any parameter)."""
    mine = {id(p) for m in model.modules() if is_per_rank(m) for p in _experts_of(m)}
    return [(n, p) for n, p in model.named_parameters() if id(p) in mine]


class _DivideGrad:
    """A gradient hook dividing by ``world`` (an object, not a closure: a model holding it
    still pickles and deep-copies)."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.world


def scale_expert_grads(model: nn.Module, world: int | None = None) -> int:
    """Divide the gradient of every per-rank expert parameter of ``model`` by ``world``
    (default: the default process group's size), so that it is the gradient of the mean of
    the ranks' losses, the objective data parallelism averages the other gradients for.
    The hook runs before the gradient is accumulated into ``.grad``: accumulation over
    micro-batches stays right. Calling it again replaces the hook; ``world=1`` removes it
    (and tells the guard the scale is the caller's choice). Returns ``world``."""
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size()
    for _, p in _rank_experts(model):
        if p in _scaled and _scaled[p][1] is not None:
            _scaled[p][1].remove()
        _scaled[p] = (world, p.register_hook(_DivideGrad(world)) if world != 1 else None)
    return world


def _check_world(model: nn.Module, size: int, what: str) -> None:
    for m in model.modules():
        if is_per_rank(m) and size != m.W:
            raise UsageError(
                f"{layer_prefix(m.layer.spec.name)} has W = {m.W} ranks, but {what} runs over {size}: "
                f"its experts' gradients sum over the W ranks' tokens, so data parallelism must run over those ranks"
            )


def data_parallel(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """``torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)`` with the per-rank
    expert parameters left out (DDP's ignore list: never broadcast, never averaged) and
    their gradients divided by the group's size (:func:`scale_expert_grads`). The router,
    shared experts and every other parameter are DDP's as usual: broadcast from rank 0 at
    construction, gradients averaged. Build the model with the same seed on every rank:
    each rank's experts are then its slice of one layer."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    group = ddp_kwargs.get("process_group")
    if group is None and ddp_kwargs.get("device_mesh") is not None:
        group = ddp_kwargs["device_mesh"].get_group()
    size = dist.get_world_size(group)
    _check_world(model, size, "DistributedDataParallel")
    names = [n for n, _ in _rank_experts(model)]
    # DDP's construction looks up named_parameters() names, its reducer "{module}.{param}",
    # which for the wrapped module's own parameters reads ".{param}": list both
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
    ignore |= {"." + n for n in names if "." not in n}
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignore))
    scale_expert_grads(model, size)
    return DistributedDataParallel(model, **ddp_kwargs)


def fully_shard(module: nn.Module, **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)`` with the per-rank expert
    parameters in ``module`` added to ``ignored_params`` (never sharded, moved or reduced)
    and their gradients divided by the mesh's size (:func:`scale_expert_grads`). Call it
    wherever ``fully_shard`` would be called: on each block, then on the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as shard

    experts = {p for _, p in _rank_experts(module)}
    if experts:
        mesh = kwargs.get("mesh")
        size = mesh.size() if mesh is not None else dist.get_world_size()
        _check_world(module, size, "fully_shard")
        scale_expert_grads(module, size)
    ignored = set(kwargs.pop("ignored_params", None) or ()) | experts
    return shard(module, ignored_params=ignored or None, **kwargs)


def check_experts(moe: nn.Module) -> None:
    """Raise :class:`rdepc.UsageError` (one line) when ``moe``'s per-rank expert parameters
    were sharded (FSDP2's ``fully_shard`` turns a parameter it shards into a DTensor). A
    type test per expert parameter; nothing on one-process backends."""
    if not is_per_rank(moe):
        return
    from torch.distributed.tensor import DTensor

    sharded = [n for n in EXPERT_WEIGHTS if isinstance(moe._parameters.get(n), DTensor)]
    if sharded:
        raise UsageError(
            f"fully_shard sharded {', '.join(sharded)} of {layer_prefix(moe.layer.spec.name)}, its per-rank experts "
            f"(each rank holds its own): {FIX_FSDP}"
        )


def _check_ddp(ddp) -> None:
    ignore = ddp.parameters_to_ignore
    for mname, m in ddp.module.named_modules():
        if not is_per_rank(m):
            continue
        for pname in EXPERT_WEIGHTS:
            if m._parameters.get(pname) is None:
                continue
            name = f"{mname}.{pname}" if mname else pname
            what = f"{name}, per-rank experts of {layer_prefix(m.layer.spec.name)} (each rank holds its own)"
            if name not in ignore:  # the construction's name
                raise UsageError(
                    f"DistributedDataParallel covers {what}, as if replicated: it copies rank 0's over the other "
                    f"ranks' at construction and averages gradients; build the model again and wrap it with {FIX_DDP}"
                )
            if f"{mname}.{pname}" not in ignore:  # the reducer's
                raise UsageError(
                    f"DistributedDataParallel would average the gradients of {what}: its reducer looks the "
                    f"wrapped module's own parameters up as '.{pname}', which its ignore list lacks; "
                    f"wrap the model with {FIX_DDP}"
                )
        _check_scaled(m, "DistributedDataParallel")


def _check_scaled(moe: nn.Module, wrapper: str) -> None:
    if any(p not in _scaled for p in _experts_of(moe)):
        raise UsageError(
            f"the per-rank expert gradients of {layer_prefix(moe.layer.spec.name)} are not divided by the world "
            f"size, as {wrapper}'s mean over ranks needs: call rdepc.distributed.scale_expert_grads(model) "
            f"(rdepc.distributed.data_parallel and fully_shard do)"
        )


def _check_wrapper(module: nn.Module) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        _check_ddp(module)
        return
    for m in module.modules():  # an FSDP2 module
        if is_per_rank(m):
            check_experts(m)
            _check_scaled(m, "fully_shard")


def _pre_forward(module: nn.Module, args) -> None:
    # Every module's forward in the process passes here: one type test, and for a DDP or
    # FSDP2 module one dict lookup once it has passed. Its construction had no hook to
    # catch; its first forward is before any step.
    if isinstance(module, _wrappers) and _checked not in module.__dict__ and not torch.compiler.is_compiling():
        _check_wrapper(module)
        module.__dict__[_checked] = True


def _install_guard() -> None:
    global _guard, _wrappers
    if _guard is not None:
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    _wrappers = (DistributedDataParallel, FSDPModule)
    _guard = torch.nn.modules.module.register_module_forward_pre_hook(_pre_forward)


__all__ = [
    "EXPERT_WEIGHTS",
    "check_experts",
    "data_parallel",
    "dense_parameters",
    "expert_parameters",
    "fully_shard",
    "is_expert",
    "mark_experts",
    "scale_expert_grads",
]
