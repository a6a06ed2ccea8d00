"""Checkpoints that reshard: an ``RDEPMoE``'s routed experts in its state dict one expert per
key, by global id, so that a checkpoint saved at W ranks loads at any other W.

A block's state dict holds, for every expert ``e`` it owns (all E in one process, a rank's
own on a per-rank backend), ``{prefix}experts.{e}.w_gate_up`` [H, F, 2] (gated experts) or
``{prefix}experts.{e}.w_up`` [H, F], and ``{prefix}experts.{e}.w_down`` [F, H] (and its
biases, when the spec's experts have them: ``b_gate_up`` [F, 2] or ``b_up`` [F], ``b_down``
[H]): views of
that expert's row of the parameter, so that ``torch.distributed.checkpoint.load`` (which
writes into the tensors it is given) fills the parameters directly. The whole-tensor keys
``w_gate_up`` / ``w_up`` / ``w_down`` do not appear. The router and its biases, the shared
experts and their gate keep their ordinary keys: they are replicated.

Loading (``load_state_dict``) takes the block's own experts from such keys and drops every
other expert's: each rank can load the whole layer's state dict strictly, and a DCP
checkpoint written by any W holds exactly the keys another W asks for. An own expert with no
key is reported missing (``experts.{e}.w_down``), and its row left as it was. The whole
tensors of older checkpoints are still accepted: [E, ...] in global order (a rank takes its
rows), or the block's own [E_loc, ...]. Expert rows are copied into the parameters in place;
with ``assign=True`` (a block built on the meta device) its rows, all given, are stacked and
assigned.

Optimizer state is keyed by parameter, and an expert parameter's state is the rank's
[E_loc, ...] rows: :func:`optimizer_state_dict` presents it per expert in the same way
(``state[{prefix}experts.{e}.{name}]``) and :func:`load_optimizer_state_dict` takes it back.

``RDEPMoE`` calls :func:`install` when it is built.
"""

from __future__ import annotations

import re
from itertools import chain

import torch
from torch import nn

# those a block has: gated w_gate_up, else w_up; w_down; with expert biases b_gate_up or b_up, and b_down
EXPERT_PARAMS = ("w_gate_up", "w_up", "w_down", "b_gate_up", "b_up", "b_down")
_KEY = re.compile(r"experts\.(\d+)\.(\w+)")


def expert_key(prefix: str, e: int, name: str) -> str:
    return f"{prefix}experts.{e}.{name}"


def _params(module: nn.Module) -> list[str]:
    return [n for n in EXPERT_PARAMS if module._parameters.get(n) is not None]


def install(module: nn.Module) -> None:
    """Register the state-dict hooks on an ``RDEPMoE`` (``experts``: its experts' global ids,
    in the order of its parameters' rows)."""
    module.register_state_dict_post_hook(_save_hook)
    module.register_load_state_dict_pre_hook(_load_hook)
    # torch.distributed.checkpoint.state_dict finds a key's FQN by walking it as attributes
    # (``experts``, then ``{e}``, then the name); ``experts`` itself is a tuple of ids.
    module._fqn_modifiers = _FqnModifiers()
    module._checkpoint_keys = _KeyPath(module)


class _FqnModifiers:
    def __call__(self) -> dict[str, str]:
        return {"experts": "_checkpoint_keys"}


class _KeyPath:
    """Resolves ``experts.{e}.{name}`` by attribute, as DCP's FQN walk does: that expert's row."""

    def __init__(self, module: nn.Module, local: int | None = None, depth: int = 0):
        self._module, self._local, self._depth = module, local, depth

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        m = self._module
        if self._depth == 0 and attr == "experts":
            return _KeyPath(m, None, 1)
        if self._depth == 1 and attr.isdigit() and int(attr) in m.experts:
            return _KeyPath(m, m.experts.index(int(attr)), 2)
        if self._depth == 2 and attr in _params(m):
            return m._parameters[attr][self._local]
        raise AttributeError(attr)


def _save_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Each expert parameter's entry replaced by one view per expert, in place and in order."""
    whole = {prefix + n: n for n in _params(module)}
    keys = list(state_dict)
    at = [i for i, k in enumerate(keys) if k in whole]
    if not at:
        return
    for k, v in [(k, state_dict.pop(k)) for k in keys[min(at) :]]:  # re-inserted: the order is kept
        if k not in whole:
            state_dict[k] = v
            continue
        for i, e in enumerate(module.experts):
            state_dict[expert_key(prefix, e, whole[k])] = v[i]  # v is detached unless keep_vars


def _load_hook(
    module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """Per-expert keys: own ones copied into the rows, others dropped; whole tensors: own rows.
    What it copied it leaves as the parameter itself under the whole key, which torch's loader
    then takes as a no-op (and does not report the whole key missing). With ``assign=True``, or
    into meta parameters, a block's rows are stacked and left to torch's loader when all are given."""
    names, assign = _params(module), local_metadata.get("assign_to_params_buffers", False)
    found: dict[str, dict[int, torch.Tensor]] = {n: {} for n in names}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _KEY.fullmatch(key[len(prefix) :])
        if m and m[2] in found and int(m[1]) < module.E:
            found[m[2]][int(m[1])] = state_dict.pop(key)  # another rank's expert: dropped
    for name in names:
        param, key, rows = module._parameters[name], prefix + name, found[name]
        if key in state_dict:
            if rows:
                error_msgs.append(f"{key}: both the whole tensor and per-expert keys ({prefix}experts.N.{name}) given")
            else:
                state_dict[key] = _own_rows(module, state_dict[key], param)
            continue
        good = {}
        for i, e in enumerate(module.experts):
            ekey, row = expert_key(prefix, e, name), param[i]
            if e not in rows:
                missing_keys.append(ekey)
            elif not torch.overrides.is_tensor_like(rows[e]):
                error_msgs.append(f'While copying the parameter named "{ekey}", expected a tensor, got {type(rows[e])}')
            elif rows[e].shape != row.shape:
                error_msgs.append(
                    f"size mismatch for {ekey}: copying a param with shape {rows[e].shape} from checkpoint, "
                    f"the shape in current model is {row.shape}."
                )
            else:
                good[i] = rows[e]
        if good and len(good) == len(module.experts) and (assign or param.is_meta):
            # assign (a block built on the meta device): torch's loader takes the stacked rows
            state_dict[key] = torch.stack([good[i] for i in range(len(good))])
            continue
        with torch.no_grad():
            for i, v in good.items():
                if not _same(v, param[i]):  # DCP loads into the views state_dict() gave: nothing to copy
                    param[i].copy_(v)
        state_dict[key] = param


def _own_rows(module: nn.Module, whole, param: torch.Tensor):
    """An older whole tensor: [E, ...] in global order gives this block's rows; anything
    else is left to torch's loader (the block's own [E_loc, ...], or a size mismatch)."""
    if (
        torch.overrides.is_tensor_like(whole)
        and whole.dim() == param.dim()
        and whole.shape[0] == module.E != param.shape[0]
        and whole.shape[1:] == param.shape[1:]
    ):
        return whole[list(module.experts)]
    return whole


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


# ----------------------------------------------------------------------------- optimizer state
def _optimizers(optim) -> tuple[torch.optim.Optimizer, ...]:
    return (optim,) if isinstance(optim, torch.optim.Optimizer) else tuple(optim)


def _expert_fqns(model: nn.Module, optims, param_groups: list[dict]) -> dict[str, tuple[nn.Module, str]]:
    """FQN (as the optimizer state dict names it) -> (block, parameter name) of every expert
    parameter: DCP lists each group's FQNs in the order of the optimizers' groups."""
    owner = {}
    for m in model.modules():
        if isinstance(getattr(m, "_checkpoint_keys", None), _KeyPath):
            owner.update({id(m._parameters[n]): (m, n) for n in _params(m)})
    params = chain.from_iterable(g["params"] for o in optims for g in o.param_groups)
    fqns = chain.from_iterable(g["params"] for g in param_groups)
    return {f: owner[id(p)] for p, f in zip(params, fqns, strict=True) if id(p) in owner}


def _check_options(options) -> None:
    if options is not None and options.flatten_optimizer_state_dict:
        raise ValueError("rdepc.checkpoint: flatten_optimizer_state_dict is not supported; leave it False")


def optimizer_state_dict(model: nn.Module, optim, options=None) -> dict:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with each expert
    parameter's state presented per expert: ``state[{prefix}experts.{e}.{name}]`` holds that
    expert's rows (views) of every per-row state (Adam's ``exp_avg``, ``exp_avg_sq``) and the
    parameter's other state (``step``) as it is. ``param_groups`` keep naming the parameters,
    which every W shares. Save it with DCP beside the model's state dict; load it at any W
    into this function's result and pass that to :func:`load_optimizer_state_dict`."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _check_options(options)
    optims = _optimizers(optim)
    osd = get_optimizer_state_dict(model, optims, options=options)
    experts = _expert_fqns(model, optims, osd["param_groups"])
    state = {}
    for fqn, entry in osd["state"].items():
        if fqn not in experts:
            state[fqn] = entry
            continue
        module, name = experts[fqn]
        prefix, shape = fqn[: -len(name)], module._parameters[name].shape
        for i, e in enumerate(module.experts):
            state[expert_key(prefix, e, name)] = {
                k: v[i] if isinstance(v, torch.Tensor) and v.shape == shape else v for k, v in entry.items()
            }
    return {"state": state, "param_groups": osd["param_groups"]}


def load_optimizer_state_dict(model: nn.Module, optim, osd: dict, options=None) -> None:
    """Load an optimizer state dict in :func:`optimizer_state_dict`'s form, saved at any W:
    this rank's experts' rows stacked back into its parameters' state, other experts' dropped,
    then ``set_optimizer_state_dict``. An expert parameter with no state for any of its own
    experts gets none (as before its first step); one with state for only some is an error."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _check_options(options)
    optims = _optimizers(optim)
    experts = _expert_fqns(model, optims, osd["param_groups"])
    state = dict(osd["state"])
    for fqn, (module, name) in experts.items():
        prefix, row = fqn[: -len(name)], module._parameters[name].shape[1:]
        given = {}
        for k in [k for k in state if k.startswith(prefix)]:
            m = _KEY.fullmatch(k[len(prefix) :])
            if m and m[2] == name:
                given[int(m[1])] = state.pop(k)  # another rank's expert: dropped
        own = [given.get(e) for e in module.experts]
        if all(s is None for s in own):
            continue
        if any(s is None for s in own):
            lost = [e for e, s in zip(module.experts, own, strict=True) if s is None]
            raise ValueError(f"optimizer state for {fqn}: this rank's experts {lost} have none, its others have")
        state[fqn] = {
            k: torch.stack([s[k] for s in own]) if isinstance(v, torch.Tensor) and v.shape == row else v
            for k, v in own[0].items()
        }
    set_optimizer_state_dict(model, optims, {"state": state, "param_groups": osd["param_groups"]}, options=options)


__all__ = ["EXPERT_PARAMS", "expert_key", "install", "load_optimizer_state_dict", "optimizer_state_dict"]
