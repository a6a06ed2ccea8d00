"""Shared test setup: a deterministic hypothesis profile, so CI never flakes."""

import os
from pathlib import Path

import pytest
import torch
from device_kernels import kernels  # noqa: F401 - the device-function tests' fixture
from hypothesis import HealthCheck, settings
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants
from rdepc.runtime import ranks
from tiers import TIER_OF

from rdepc import cli
from rdepc.toolchain import interpreter_env

# Two workers (-n 2) on a machine of few cores: one thread each, for this process and (inherited)
# its subprocesses. torch's OpenMP threads otherwise spin on a core the other worker needs: on
# 2 cores, 5-11% more CPU a test file for the same wall time (the suite's tensors are small).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The suite's own processes run the generated kernels under the interpreter; native runs start
# processes of their own (TRITON_INTERPRET=0 in their environment). Triton fixes its mode when it
# is first imported: importing it here decides it for every test, whichever runs first (transformers
# imports Triton, natively unless told).
with interpreter_env(True):
    import triton.language  # noqa: F401

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parent.parent


# Hypothesis draws from the strategies as written, without the constants it would otherwise
# collect from every local module imported so far (hypothesis is pinned: pyproject.toml). Those
# modules include each generated kernel file a test imported: what a property test drew
# depended on the tests its worker had run before it, and the next property test parsed every
# such file (18 s of test_plan_properties' 21 s after test_hf.py).
NO_CONSTANTS = Constants()
providers._get_local_constants = lambda: NO_CONSTANTS

# A wall-clock bound in a test only ends a hang: whatever outlives it has stopped making
# progress, on any machine under any load (a test's subprocess or launch takes seconds to a
# minute on 2 cores; the acceptance dry run, the longest, 214 s, is given twice this). No
# test asserts speed.
HANG_S = 900


def growing_bounds(first: float):
    """first, 2·first, 4·first, ... up to :data:`HANG_S`: the bounds a test that must see a
    launch end by its own timeout tries in turn, the next only when a loaded machine had not
    reached the point the test needs within the last."""
    bound = first
    while bound <= HANG_S:
        yield bound
        bound *= 2


def orphan_heaps() -> set[str]:
    """The shared-memory heaps (``/dev/shm/`` ``ranks.HEAP_PREFIX`` + pid + tag) whose creating process has
    ended: left behind. A live creator's heap is in use, by this test or by another one that
    a second worker runs beside it (``pytest -n``)."""
    shm = Path("/dev/shm")
    left = set()
    for p in shm.glob(f"{ranks.HEAP_PREFIX}*") if shm.is_dir() else ():
        pid = p.name.removeprefix(ranks.HEAP_PREFIX).split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            left.add(p.name)
        except (ValueError, PermissionError):  # not a pid; a process of another user's: alive
            continue
    return left


EXAMPLES = sorted((ROOT / "examples").glob("*.rdep"))
# Examples whose generated kernels are another example's: what sets them apart (their routers,
# their shared experts, Qwen2's and Qwen3-Next's gate on them) is torch, not Triton.
TORCH_APART = {"deepseek_v2", "qwen2_moe", "qwen3_next_80b_a3b", "ernie45_21b_a3b", "hunyuan_a13b"}
# Examples whose kernels are another's at other sizes, the same code: nvl72_e128's are
# mixtral_8x7b's (bf16 SwiGLU, a capacity dropping round-robin, renormalised), qwen3_30b_a3b's
# moonlight's (its choices to the constant).
RESIZED = {"nvl72_e128": "mixtral_8x7b", "qwen3_30b_a3b": "moonlight"}
TINY = ROOT / "examples" / "tiny.rdep"


def tiny_segmented(directory: Path, rows: int = 32, buffers: int = 2) -> Path:
    """examples/tiny.rdep as a pipelined layer of ``rows``-row segments through ``buffers``
    ring slots, written into ``directory``. tiny itself is bulk (one segment per owner, S =
    128); tests of segmented schedules use this, where S = 32 gives each owner 4 segments."""
    text = TINY.read_text(encoding="utf-8")
    bulk = "  schedule  bulk\n"
    assert bulk in text, "examples/tiny.rdep no longer says 'schedule  bulk': update tiny_segmented"
    path = directory / f"tiny_S{rows}_B{buffers}.rdep"
    segmented = f"  segment   rows {rows}, buffers {buffers}\n  schedule  pipelined\n"
    path.write_text(text.replace(bulk, segmented), encoding="utf-8")
    return path


@pytest.fixture
def main(capsys, monkeypatch):
    """rdepc.cli.main(argv) in-process, from the repo root: (status, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")

    def call(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as e:  # argparse's own usage errors, --help and --version
            status = e.code
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return status, out, err

    return call


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A compile cache (RDEPC_CACHE_DIR) of the test's own: each test compiles its layers."""
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(tmp_path / "rdepc-cache"))


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """A compile cache (RDEPC_CACHE_DIR) the tests of one module share, and no other module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RDEPC_CACHE_DIR", str(tmp_path_factory.mktemp("rdepc-cache")))
        yield


def pytest_collection_modifyitems(config, items):
    """Each test marked with its file's tier (tests/tiers.py): ``pytest -m unit`` and so on."""
    for item in items:
        tier = TIER_OF.get(Path(str(item.fspath)).stem)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/*.json from the current compiler instead of comparing",
    )


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


GRAD_NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")


def grads_in(fn, inputs, dy, dtype) -> dict:
    """{name: fp32 gradient} of sum(y · dy) through ``fn`` (a layer or the reference), x and
    the weights in ``dtype``, the gates in fp32."""
    x, ids, g, wg, wu, wd = inputs
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, wg, wu, wd)]
    gates = g.detach().float().requires_grad_(True)
    y = fn(leaves[0], ids, gates, *leaves[1:])
    y = y[0] if isinstance(y, tuple) else y
    (y.float() * dy).sum().backward()
    return {n: t.grad.float() for n, t in zip(GRAD_NAMES, (leaves[0], gates, *leaves[1:]), strict=True)}


def block_parameters(moe) -> dict:
    """An RDEPMoE's parameters by name (detached), and its selection bias ``router_bias``."""
    params = {n: p.detach() for n, p in moe.named_parameters()}
    return params | ({} if moe.router_bias is None else {"router_bias": moe.router_bias})


def block_reference(moe):
    """fn(x, params) -> y: what the RDEPMoE ``moe`` computes for x [W, T', H] (every token real)
    with ``params`` (:func:`block_parameters`' names), by rdepc.reference: its router
    (``route``), its routed experts (``reference_for``) and its shared experts
    (``shared_experts``); in float64 when given float64, the function tests/tolerance.py's
    bounds re-run for a block."""
    from rdepc.reference import reference_for, route, shared_experts

    spec, K = moe.layer.spec, moe.K
    routed = reference_for(spec)

    def fn(x, params):
        W, T, H = x.shape
        ids, gates = route(
            x.reshape(-1, H), params["router"], spec.router, K, params.get("router_bias"),
            params.get("router_logit_bias"),
        )  # fmt: skip
        if "w_gate_up" in params:
            wg, wu = params["w_gate_up"][..., 0], params["w_gate_up"][..., 1]
        else:
            wg, wu = None, params["w_up"]
        biases = {}
        if "b_down" in params:
            b = params.get("b_gate_up")
            biases = {"b_gate": b[..., 0], "b_up": b[..., 1]} if b is not None else {"b_up": params["b_up"]}
            biases["b_down"] = params["b_down"]
        y = routed(x, ids.reshape(W, T, K), gates.reshape(W, T, K), wg, wu, params["w_down"], **biases)[0]
        if "shared_up" in params:
            shared = shared_experts(
                x, params.get("shared_gate"), params["shared_up"], params["shared_down"], moe.shared_act,
                params.get("shared_gate_proj"), *moe._shared_act_params,
            )  # fmt: skip
            y = y + shared
        return y

    return fn


def received(spec, inputs):
    """``inputs`` in fp32 with x as the experts receive it: rounded to e4m3 by the spec's fp8
    dispatch (``fp8_dispatch``, as the reference rounds it) or as it is. A layer rounds x as
    the reference does, so what differs is the arithmetic after the rounding: bound it with
    ``reference_for(spec, dispatch_rounding=False)`` on these rows (the output gate only)."""
    from rdepc.reference import fp8_dispatch

    x, *rest = (None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs)
    scale = spec.precision.dispatch_scale
    if scale is not None and spec.gate_on != "output":
        raise ValueError("with the gate on the expert's input the dispatch rounds g'·x, not x")
    x = x if scale is None else fp8_dispatch(x, scale)
    return type(inputs)(x, *rest) if hasattr(inputs, "_fields") else (x, *rest)


def reference_grads(spec):
    """fn(inputs, dy) -> {name: gradient} of sum(y · dy) through the reference from the experts'
    rows on (x as :func:`received` rounds it), in the inputs' dtype: what tests/tolerance.py's
    bounds re-run for a layer's gradients."""
    from rdepc.reference import reference_for

    ref = reference_for(spec, dispatch_rounding=False)

    def fn(inputs, dy):
        x, ids, g, wg, wu, wd = inputs
        leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, g, wg, wu, wd)]
        (ref(leaves[0], ids, *leaves[1:])[0] * dy).sum().backward()
        return {n: t.grad for n, t in zip(GRAD_NAMES, leaves, strict=True) if t is not None}

    return fn


def layer_bound(layer, inputs, dtype=None):
    """The bound (tests/tolerance.py) of ``layer``'s output on ``inputs`` against the reference's
    on the same (fp8-rounded) rows; ``dtype``: the one the layer rounds its intermediates to
    (None: fp32)."""
    from tolerance import NARROWINGS, bound, layer_chain

    from rdepc.reference import reference_for

    sh = layer.shapes
    chain = layer_chain(sh["H"], sh["F"], sh["K"]) if dtype in (None, torch.float32) else NARROWINGS
    fn = reference_for(layer.spec, dispatch_rounding=False)
    return bound(fn, received(layer.spec, inputs), chain, dtype or torch.float32)


def layer_grad_bounds(layer, inputs, dy, dtype=None) -> dict:
    """{name: bound} of ``layer``'s gradients of sum(y · dy) against autograd through the
    reference (:func:`reference_grads`): the layer's chain and the W·T·K rows a weight's sums."""
    from tolerance import NARROWINGS, bounds, layer_chain

    sh = layer.shapes
    chain = layer_chain(sh["H"], sh["F"], sh["K"], extra=sh["W"] * sh["T"] * sh["K"])
    args = (received(layer.spec, inputs), dy)
    narrow = dtype not in (None, torch.float32)
    return bounds(reference_grads(layer.spec), args, NARROWINGS if narrow else chain, dtype or torch.float32)
