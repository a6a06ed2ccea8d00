"""Checkpoints that reshard (rdepc.checkpoint): an RDEPMoE's state dict holds one key per
expert, by global id, so a checkpoint saved at W ranks loads at another W.

In one process: the keys and their shapes, a strict round trip, a W=4 block's state dict
loaded into a W=2 block, older whole-tensor keys, missing and foreign experts. Across
processes: a torch.distributed.checkpoint (DCP) checkpoint of a W=4 per-rank block, after
one Adam step, loaded by 2 rank processes at W=2 built from another seed: outputs and
optimizer state equal the W=4 run's bitwise (tiny is dropless and fp32: a token's output
does not depend on W, nor on which rank computes its experts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import HANG_S, ROOT
from rdepc.runtime import ranks
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import rdepc
from rdepc import checkpoint as C

TINY = str(ROOT / "examples" / "tiny.rdep")  # fp32, dropless, swiglu, H=64, F=128, E=8, K=2
N = 16  # global tokens: T' = 4 per rank at W = 4, 8 at W = 2


def block(W: int, seed: int, backend: str = "emulated") -> rdepc.RDEPMoE:
    return rdepc.RDEPMoE(TINY, backend=backend, generator=torch.Generator().manual_seed(seed), W=W)


def tokens() -> torch.Tensor:
    return torch.randn(N, 64, generator=torch.Generator().manual_seed(3))


def test_one_key_per_expert_views_of_the_rows():
    moe = block(4, 1)
    sd = moe.state_dict()
    assert list(sd) == ["router"] + [f"experts.{e}.w_gate_up" for e in range(8)] + [
        f"experts.{e}.w_down" for e in range(8)
    ]
    for e in range(8):
        assert sd[f"experts.{e}.w_gate_up"].shape == (64, 128, 2)
        assert sd[f"experts.{e}.w_down"].shape == (128, 64)
        assert not sd[f"experts.{e}.w_down"].requires_grad
        assert sd[f"experts.{e}.w_down"].data_ptr() == moe.w_down[e].data_ptr()  # a view: DCP loads in place
    assert moe.state_dict(keep_vars=True)["experts.1.w_down"].requires_grad
    # nested, and as torch.distributed.checkpoint.state_dict names them
    outer = torch.nn.ModuleDict({"moe": moe})
    assert "moe.experts.7.w_gate_up" in outer.state_dict()
    assert list(get_model_state_dict(outer)) == ["moe." + k for k in sd]


def test_strict_round_trip_and_w4_into_w2_give_equal_outputs():
    src, x = block(4, 1), tokens()
    want = src(x)
    same, fewer_ranks = block(4, 2), block(2, 2)
    assert not torch.equal(same.w_down, src.w_down)
    for dst in (same, fewer_ranks):
        dst.load_state_dict(src.state_dict())  # strict
        assert torch.equal(dst(x), want)
    # through DCP's own functions as well
    other = block(2, 3)
    set_model_state_dict(other, get_model_state_dict(src))
    assert torch.equal(other.w_gate_up, src.w_gate_up) and torch.equal(other.router, src.router)


def test_whole_tensor_keys_missing_and_unknown_experts():
    src = block(4, 1)
    old = {"router": src.router.detach(), "w_gate_up": src.w_gate_up.detach(), "w_down": src.w_down.detach()}
    dst = block(2, 2)
    dst.load_state_dict(old)  # the whole tensors of older checkpoints: strict
    assert torch.equal(dst.w_gate_up, src.w_gate_up) and torch.equal(dst.w_down, src.w_down)

    sd = block(4, 5).state_dict()
    del sd["experts.3.w_down"], sd["experts.6.w_gate_up"]
    missing = r'Missing key\(s\) in state_dict: "experts.6.w_gate_up", "experts.3.w_down"'
    with pytest.raises(RuntimeError, match=missing):
        dst.load_state_dict(sd)
    before = dst.w_down[3].clone()
    result = dst.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["experts.6.w_gate_up", "experts.3.w_down"] and not result.unexpected_keys
    assert torch.equal(dst.w_down[3], before) and torch.equal(dst.w_down[4], sd["experts.4.w_down"])

    sd = src.state_dict() | {"experts.8.w_down": torch.zeros(128, 64), "experts.0.w_up": torch.zeros(64, 128)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "experts.8.w_down", "experts.0.w_up"'):
        dst.load_state_dict(sd)
    sd = src.state_dict() | {"experts.2.w_down": torch.zeros(64, 64)}
    with pytest.raises(RuntimeError, match=r"size mismatch for experts.2.w_down: copying a param with shape"):
        dst.load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"w_down: both the whole tensor and per-expert keys"):
        dst.load_state_dict(src.state_dict() | {"w_down": src.w_down.detach()})


def test_assign_and_meta_blocks_take_the_rows_stacked():
    src = block(4, 1)
    for dst in (block(2, 2), rdepc.RDEPMoE(TINY, device="meta", W=2)):
        dst.load_state_dict(src.state_dict(), assign=True)
        for name in ("router", "w_gate_up", "w_down"):
            p = getattr(dst, name)
            assert isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" and p.requires_grad
            assert torch.equal(p, getattr(src, name))


def step(moe, opt) -> None:
    """One Adam step on gradients drawn for all E experts (each block takes its experts' rows)
    and the router: every W and rank gives each expert the same update."""
    g = torch.Generator().manual_seed(11)
    for name, p in moe.named_parameters():
        full = torch.randn((moe.E, *p.shape[1:]) if name != "router" else p.shape, generator=g)
        p.grad = full if name == "router" else full[list(moe.experts)]
    opt.step()


def test_optimizer_state_per_expert_round_trip():
    moe = block(4, 1)
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    step(moe, opt)
    osd = C.optimizer_state_dict(moe, opt)
    assert osd["param_groups"][0]["params"] == ["router", "w_gate_up", "w_down"]
    e5 = osd["state"]["experts.5.w_gate_up"]
    assert e5["exp_avg"].data_ptr() == opt.state[moe.w_gate_up]["exp_avg"][5].data_ptr() and e5["step"] == 1
    fresh = block(2, 2)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    C.load_optimizer_state_dict(fresh, opt2, osd)
    for p, q in ((moe.w_down, fresh.w_down), (moe.w_gate_up, fresh.w_gate_up), (moe.router, fresh.router)):
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


# ----------------------------------------------------------------------------- DCP across processes
def expert_state(moe, opt) -> dict:
    """{(global expert, parameter, state): row} and the router's state, for comparing runs."""
    out = {("router", k): v.clone() for k, v in opt.state[moe.router].items()}
    for name in ("w_gate_up", "w_down"):
        for k, v in opt.state[moe._parameters[name]].items():
            for i, e in enumerate(moe.experts):
                out[(e, name, k)] = v[i].clone() if v.dim() else v.clone()
    return out


def save_rank(rank: int, W: int, path: str):
    """W=4: one Adam step, then this rank's output on its tokens and a DCP checkpoint."""
    moe = block(W, 1, "emulated-mp")
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    step(moe, opt)
    T = N // W
    with torch.no_grad():
        y = moe(tokens()[rank * T : (rank + 1) * T])
    dcp.save({"model": get_model_state_dict(moe), "optim": C.optimizer_state_dict(moe, opt)}, checkpoint_id=path)
    return y, expert_state(moe, opt)


def load_rank(rank: int, W: int, path: str, whole: dict, per_expert: dict):
    """W=2, another seed: the DCP checkpoint loaded into this rank's own state dicts; then
    one-process state dicts of the whole layer, strictly: per expert, and whole tensors."""
    moe = block(W, 2, "emulated-mp")
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    sd = {"model": moe.state_dict(), "optim": C.optimizer_state_dict(moe, opt)}
    dcp.load(sd, checkpoint_id=path)
    moe.load_state_dict(sd["model"])
    C.load_optimizer_state_dict(moe, opt, sd["optim"])
    T = N // W
    with torch.no_grad():
        y = moe(tokens()[rank * T : (rank + 1) * T])
    mine, loaded = list(moe.experts), []
    for given in (per_expert, whole):  # other ranks' experts dropped; whole tensors: this rank's rows
        other = block(W, 3, "emulated-mp")
        other.load_state_dict(given)
        loaded.append(torch.equal(other.w_gate_up, whole["w_gate_up"][mine]))
        loaded.append(torch.equal(other.w_down, whole["w_down"][mine]))
    return y, expert_state(moe, opt), loaded


def test_dcp_checkpoint_saved_at_w4_loads_at_w2_with_equal_outputs(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks.spawn(save_rank, 4, path, timeout=HANG_S)
    src = block(4, 9)
    whole = {"router": src.router.detach(), "w_gate_up": src.w_gate_up.detach(), "w_down": src.w_down.detach()}
    loaded = ranks.spawn(load_rank, 2, path, whole, dict(src.state_dict()), timeout=HANG_S)
    assert torch.equal(torch.cat([y for y, _ in saved]), torch.cat([y for y, *_ in loaded]))
    want = {k: v for _, state in saved for k, v in state.items()}
    got = {k: v for _, state, _ in loaded for k, v in state.items()}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(all(ok) for *_, ok in loaded)
