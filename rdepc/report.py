"""The human report of ``rdepc plan``: aligned tables with units, the accounting behind
every figure in words, one verdict line per memory budget, and warnings.

Pure text from a :class:`rdepc.passes.plan_records.Plan`; ``--json`` uses ``to_json`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from rdepc.diagnostics import owning
from rdepc.ir.sizes import BM
from rdepc.passes.memplan import BACKWARD_REGIONS
from rdepc.passes.plan_records import Plan, SymmetricPlan
from rdepc.passes.plan_symbols import SYMBOLS_DOC, Figure

GIB = 2**30


def fmt_bytes(n: float | None) -> str:
    """GiB from a tenth of a GiB up, MB (10^6) from 1 MB, else exact bytes."""
    if n is None:
        return "-"
    if n >= GIB / 10:
        return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / GIB:.3f} GiB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{int(n):,} B"


def fmt_num(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.2f}" if abs(v) >= 10 else f"{v:.4g}"


def _flops(fig: Figure) -> str:
    return f"{fig.value / 1e12:,.2f} TFLOP" if fig.value >= 1e10 else f"{fig.value / 1e9:,.3f} GFLOP"


def fmt(fig: Figure | None) -> str:
    if fig is None or fig.value is None:
        return "-"
    v = fig.value
    if isinstance(v, float) and math.isinf(v):
        return "unbounded"
    u = fig.unit
    if u == "B":
        return fmt_bytes(v)
    if u == "rows":
        return f"{fmt_num(v)} rows"
    if u == "s":
        return f"{v * 1e6:,.1f} µs" if v * 1e6 >= 10 else f"{v * 1e6:.2f} µs"
    if u == "frac":
        return f"{v * 100:.2f} %"
    if u == "x":
        return f"{v:.3f}x" if v < 10 else f"{v:,.1f}x"
    if u == "params":
        return f"{v / 1e9:.3f} B params"
    if u == "prob":
        return "0" if v == 0 else f"{v:.3g}"
    return fmt_num(v)


def table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None, indent: int = 2) -> list[str]:
    """Left-aligned text columns, the value columns (all but first and last) right-aligned."""
    allrows = [list(header)] + [list(r) for r in rows] if header else [list(r) for r in rows]
    n = max(len(r) for r in allrows)
    for r in allrows:
        r += [""] * (n - len(r))
    widths = [max(len(r[i]) for r in allrows) for i in range(n)]
    out = []
    for k, r in enumerate(allrows):
        cells = []
        for i, c in enumerate(r):
            cells.append(c.rjust(widths[i]) if 0 < i < n - 1 else c.ljust(widths[i]))
        out.append((" " * indent + "  ".join(cells)).rstrip())
        if header and k == 0:
            out.append(" " * indent + "  ".join("-" * w for w in widths))
    return out


def _fig_rows(items: Sequence[tuple[str, Figure | None]]) -> list[list[str]]:
    return [[label, fmt(fig), fig.what if fig else ""] for label, fig in items if fig is not None]


def _heap_rows(s: SymmetricPlan) -> list[list[str]]:
    fwd = {f.key.rsplit(".", 1)[1]: f for f in s.forward}
    fb = {f.key.rsplit(".", 1)[1]: f for f in s.forward_backward}
    rows = []
    for name, fig in fb.items():
        f_fig = fwd.get(name)
        rows.append([name, fmt(f_fig) if f_fig else "-", fmt(fig), f"{fig.value:,} B", fig.what])
    return rows


def _header(pl: Plan) -> Iterator[str]:
    """The layer, its sizes and choices, and the hardware profile's figures with their sources."""
    v = dict(pl.values)
    cp = pl.capacity
    hw = pl.hw
    yield f"rdepc plan: layer {pl.layer} ({pl.file})"
    tnote = f" (T is symbolic, T <= {pl.t_bound}: figures at the bound)" if pl.t_bound is not None else ""
    yield (
        f"  W={v['W']} T={v['T']} H={v['H']} E={v['E']} K={v['K']} F={v['F']} L={v['L']}{tnote}; "
        f"{pl.precision} ({v['a']} B, {v['d']} B), sideband {v['sb']} B/row"
    )
    seg = f"segment S={v['S']} B={v['B']}" if "S" in v else "no segment statement"
    cap = cp.policy if cp.rows_per_expert is None else f"{cp.policy} (cap_e = {cp.rows_per_expert.value:,} rows)"
    yield f"  capacity {cap}; {seg}; symmetric heap strategy: {pl.strategy}"
    yield f"  expert GEMMs {pl.gemm[0]} ({pl.gemm[1]})"
    yield f"  hardware {hw.name}: {hw.description}"
    hw_rows = []
    for name, val in hw.values().items():
        shown = {
            "flops": f"{val.value / 1e12:,.1f} TFLOP/s",
            "link": f"{val.value / 1e9:,.0f} GB/s",
            "hbm": f"{val.value / GIB:,.1f} GiB",
            "hbm_bw": f"{val.value / 1e12:,.2f} TB/s",
            "barrier_per_peer": f"{val.value * 1e9:,.0f} ns",
        }[name]
        hw_rows.append([name, shown, val.kind, val.source])
    yield from table(hw_rows, indent=4)


def _pooling(pl: Plan) -> Iterator[str]:
    """Rows per expert and per owner under uniform routing."""
    po = pl.pooling
    yield ""
    yield "Pooling (uniform independent routing, DP = W)"
    asym = "unbounded (a rank owns no expert)" if math.isinf(po.asymmetry.value) else fmt(po.asymmetry)
    per_owner = sorted(set(po.experts_per_owner), reverse=True)
    counts = ", ".join(owning(po.experts_per_owner.count(k), k) for k in per_owner)
    rows = _fig_rows(
        [
            ("mu, mean rows per expert", po.mu),
            ("rows per expert per replica", po.mu_replica),
            ("CV of rows per expert", po.cv_uniform),
        ]
    )
    rows.append(["experts per owner", f"{po.e_min.value}..{po.e_max.value}", counts])
    rows.append(["owner-load asymmetry", asym, po.asymmetry.what])
    rows += _fig_rows([("expected load, busiest owner", po.owner_load_expected)])
    yield from table(rows, ["figure", "value", "accounting"])


def _capacity(pl: Plan) -> Iterator[str]:
    """cap_e, the overflow bounds, and with --probs the skewed bound."""
    cp = pl.capacity
    yield ""
    yield f"Capacity ({cp.policy}; overflow target {cp.target:g})"
    rows = _fig_rows(
        [
            ("cap_e, rows per expert", cp.rows_per_expert),
            ("worst-case owner load", cp.worst_owner_load),
            ("rows per owner (admitted)", cp.rows_per_owner),
            ("slack beta", cp.beta),
            ("union bound (raw)", cp.overflow_union_bound),
            ("P(any expert overflows)", cp.overflow_bound),
            ("factor needed for target", cp.factor_needed),
            ("cap_e needed for target", cp.rows_per_expert_needed),
        ]
    )
    if cp.overflow_branch not in ("dropless",):
        rows.append(["bound branch", cp.overflow_branch, "which tail bound applies at this beta"])
    yield from table(rows, ["figure", "value", "accounting"])
    if cp.skew is not None:
        sk = cp.skew
        yield f"  with --probs (sum p_e = {sk.sum_p:.4g}; Poisson-binomial, eq. 18):"
        yield from table(
            _fig_rows(
                [
                    ("hottest expert mean", sk.mu_e_max),
                    ("busiest owner mean", sk.owner_load_max),
                    ("P(any expert overflows)", sk.overflow_bound),
                    ("cap_e needed for target", sk.rows_per_expert_needed),
                    ("as a factor of mu", sk.factor_needed),
                ]
            ),
            indent=4,
        )


def _memory(pl: Plan) -> Iterator[str]:
    """The paper's Table 4 symmetric memory, then rdepc's heap plan region by region."""
    v = dict(pl.values)
    mem = pl.memory
    yield ""
    yield "Symmetric memory, the paper's convention (Table 4: 4 routed row tensors of H·d bytes per row)"
    rows = [
        ["bulk (M_cap = W·T·K rows)", fmt(mem.bulk_per_layer), fmt(mem.bulk_total), fmt(mem.bulk_shared)],
    ]
    if mem.segmented_per_layer is not None:
        rows.append(
            [
                "segmented (B·S rows)",
                fmt(mem.segmented_per_layer),
                fmt(mem.segmented_total),
                fmt(mem.segmented_shared),
            ]
        )
    yield from table(rows, ["mode", "per layer", f"x {v['L']} layers (private)", "one shared ring"])

    s = mem.plan
    yield ""
    yield (
        f"Symmetric heap, rdepc's plan ({s.strategy}: S = {s.S.value:,} rows, B = {s.B.value}, "
        f"R_ret = {s.R_ret.value:,} rows; every buffer padded to 256 B; docs/memory.md)"
    )
    yield from table(_heap_rows(s), ["region", "forward", "fwd+bwd", "fwd+bwd bytes", "accounting"])
    yield from table(
        _fig_rows(
            [
                ("per layer x L (private rings)", s.private_total),
                ("one shared ring", s.shared_total),
                ("inference: per layer x L", s.inference_private_total),
                ("inference: one shared ring", s.inference_shared_total),
            ]
        ),
    )
    if mem.alternative is not None:
        alt = mem.alternative
        fb = alt.forward_backward[-1]
        yield (
            f"  for comparison, {alt.strategy} (S = {alt.S.value:,}, B = {alt.B.value}): fwd+bwd {fmt(fb)} "
            f"per layer, {fmt(alt.private_total)} for {v['L']} layers"
        )


def _other_memory(pl: Plan) -> Iterator[str]:
    """Routing context, saved activations, weights and training state; a verdict per budget."""
    v = dict(pl.values)
    mem = pl.memory
    hw = pl.hw
    yield ""
    yield "Other memory per GPU"
    rows = _fig_rows(
        [
            ("routing context (eq. 20)", mem.routing_context),
            ("saved owner rows", mem.saved_rows),
            ("saved bytes per row", mem.saved_row_bytes),
            ("saved activations per layer", mem.saved_per_layer),
            ("  expected load instead", mem.saved_expected),
            (f"saved activations x {v['L']}", mem.saved_total),
            ("outputs and x kept per layer", mem.saved_outputs),
            (f"outputs and x kept x {v['L']}", mem.saved_outputs_total),
            ("dense params lower bound", mem.dense_params),
            ("dense weights lower bound", mem.dense_bytes),
            ("params per routed expert", mem.training.params_per_expert),
            ("expert weights per layer", mem.training.weights_per_layer),
            (f"expert weights x {v['L']}", mem.training.weights_total),
            (f"expert gradients x {v['L']}", mem.training.grads_total),
            (f"optimizer state x {v['L']}", mem.training.optimizer_total),
            ("expert training state", mem.training.total),
        ]
    )
    yield from table(rows, ["figure", "value", "accounting"])

    yield ""
    yield f"Verdicts against {hw.name} HBM ({fmt_bytes(hw.hbm.value)})"
    width = max(len(x.budget) for x in pl.verdicts)
    for vd in pl.verdicts:
        if vd.fits:
            verdict = f"fits, {fmt_bytes(vd.margin)} to spare ({100 * vd.bytes / vd.hbm:.1f} % of HBM)"
        else:
            verdict = f"DOES NOT FIT: {fmt_bytes(-vd.margin)} over ({vd.bytes / vd.hbm:.2f}x HBM)"
        yield f"  {vd.budget.ljust(width)}  {fmt_bytes(vd.bytes).rjust(10)}  {verdict}"


def _transport(pl: Plan) -> Iterator[str]:
    """Bytes and time per stage for the busiest rank, and the barriers."""
    tr = pl.transport
    hw = pl.hw
    yield ""
    yield (
        f"Transport per rank per layer, the busiest rank (expected: uniform routing; worst: distinct top-K, "
        f"capped by capacity; time at {hw.link.value / 1e9:,.0f} GB/s)"
    )
    rows = []
    for st in tr.stages:
        rows.append(
            [
                st.name,
                fmt(st.row_bytes),
                fmt(st.send_expected),
                fmt(st.send_worst),
                fmt(st.recv_expected),
                fmt(st.recv_worst),
                fmt(st.time_expected),
                fmt(st.time_worst),
            ]
        )
    header = ["stage", "row", "send exp", "send worst", "recv exp", "recv worst", "time exp", "time worst"]
    yield from table(rows, header)
    for st in tr.stages:
        yield f"  {st.name}: {st.what}"
    yield "  the busiest owner receives min(E_max·mu, R_max) rows expected, R_max at worst; a front-end sends T·K rows"
    yield ""
    rows = [
        [
            "one barrier",
            fmt(tr.barrier),
            f"W x {hw.barrier_per_peer.value * 1e9:.0f} ns per peer; {fmt(tr.barrier_low)}..{fmt(tr.barrier_high)} "
            "at 50..100 ns (Prop. B.7)",
        ],
        ["barriers per segment", fmt(tr.barrier_segment), tr.barrier_segment.what],
        ["segments per layer", fmt(tr.segments), tr.segments.what],
        ["barrier time per layer", fmt(tr.barrier_layer), tr.barrier_layer.what],
    ]
    if tr.segment_time is not None:
        rows.append(["segment dispatch time", fmt(tr.segment_time), tr.segment_time.what])
    rows.append(["min ffn hiding transport", f"{tr.min_ffn.value:,.0f}", tr.min_ffn.what])
    rows.append(["expert ffn / minimum", fmt(tr.ffn_margin), f"F = {tr.ffn.value:,}"])
    yield from table(rows, ["figure", "value", "accounting"])


def _compute(pl: Plan) -> Iterator[str]:
    """The expert GEMMs' FLOPs and time per rank."""
    if pl.compute is not None:
        c = pl.compute
        yield ""
        rate = f"{pl.hw.flops.value / 1e12:.1f} TFLOP/s"
        yield f"Expert compute per rank per layer (time at {rate}; the shared experts' backward is 2x their forward)"
        rows = [
            ["routed experts, busiest owner", _flops(c.routed), fmt(c.routed_time), _flops(c.routed_worst),
             fmt(c.routed_worst_time), c.routed.what],
            ["  its backward", _flops(c.routed_backward), fmt(c.routed_backward_time),
             _flops(c.routed_backward_worst), fmt(c.routed_backward_worst_time), c.routed_backward.what],
        ]  # fmt: skip
        if c.shared is not None:
            rows.append(["shared experts, a front-end", _flops(c.shared), fmt(c.shared_time), "", "", c.shared.what])
        yield from table(rows, ["GEMMs", "FLOPs exp", "time exp", "FLOPs worst", "time worst", "accounting"])


def _projection(pl: Plan) -> Iterator[str]:
    """The node projection (rdepc.passes.projection), or why there is none."""
    if isinstance(pl.projection, str):
        yield ""
        yield f"Projection: {pl.projection}"
    elif pl.projection is not None:
        from rdepc.passes.projection import lines

        yield ""
        yield from lines(pl.projection)


def _dedup(pl: Plan) -> Iterator[str]:
    """What one payload row per (token, owner) saves."""
    dd = pl.dedup
    yield ""
    state = "on in this spec" if dd.enabled else "off in this spec"
    yield f"Dedup (one payload row per (token, owner), out and back; uniform routing): {state}"
    rows = _fig_rows(
        [
            ("owners per token", dd.owners_per_token),
            ("redundant route rows", dd.redundant),
            ("dispatch send, dedup", dd.dispatch_send),
            ("return recv, dedup", dd.return_recv),
            ("backward dispatch send, dedup", dd.bwd_dispatch_send),
            ("backward return recv, dedup", dd.bwd_return_recv),
        ]
    )
    yield from table(rows, ["figure", "value", "accounting"])


def _padding(pl: Plan) -> Iterator[str]:
    """One sampled routing's rows per expert and padding (--routing)."""
    if pl.padding is not None:
        pd = pl.padding
        how = "uniform" if pd.routing == "uniform" else f"zipf alpha={pd.alpha:g}"
        yield ""
        yield f"Padding, one sampled routing ({how}, seed {pd.seed}; each token picks K distinct experts)"
        rows = _fig_rows(
            [
                ("mean rows per expert", pd.mu),
                ("CV of rows per expert", pd.cv),
                ("p10 rows per expert", pd.p10),
                ("rows dropped", pd.dropped),
                ("busiest owner load", pd.max_owner_load),
                ("rho, padded to tallest", pd.rho_tallest),
                ("rho, worst owner", pd.rho_tallest_max),
                (f"rdepc tiling (BM = {BM})", pd.rho_tiled),
                ("owners per token", pd.owners_per_token),
                ("redundant route rows", pd.redundant),
            ]
        )
        yield from table(rows, ["figure", "value", "accounting"])


def _balance(pl: Plan) -> Iterator[str]:
    """balance replicate: slots, exchange and the imbalance before and after."""
    if pl.balance is not None:
        bl = pl.balance
        yield ""
        yield f"Balance: replicate hot experts, N = {bl.slots} slots per rank, at least {bl.min_rows} rows a replica"
        items = [("slot memory per rank", bl.slot_bytes), ("exchange allocation per rank", bl.exchange_bytes)]
        if bl.imbalance_before is None:
            rows = _fig_rows(items)
            rows.append(["owner imbalance", "-", "needs a routing: --routing uniform or zipf:ALPHA"])
        else:
            items += [
                ("owner imbalance, before", bl.imbalance_before),
                ("owner imbalance, after", bl.imbalance_after),
                ("replicas", bl.replicas),
                ("busiest rank's GEMMs, before", bl.time_before),
                ("busiest rank's GEMMs, after", bl.time_after),
                ("replicas' weights moved", bl.weight_bytes),
                ("busiest rank's pushes", bl.weight_time),
            ]
            rows = _fig_rows(items)
        yield from table(rows, ["figure", "value", "accounting"])


def _warnings(pl: Plan) -> Iterator[str]:
    """The plan's warnings, or that there are none."""
    yield ""
    if pl.warnings:
        for w in pl.warnings:
            yield f"warning: {w}"
    else:
        yield "no warnings"


def _formulas(pl: Plan) -> Iterator[str]:
    """With --symbolic: the formula behind every figure, and the symbols."""
    yield ""
    yield "Formulas (forward_backward repeats the forward regions; the symbols are listed below)"
    for fig in pl.figures():
        head, _, region = fig.key.rpartition(".")
        if head.endswith(".forward_backward") and region not in (*BACKWARD_REGIONS, "total"):
            continue
        if fig.formula is not None:
            yield f"  {fig.key} = {fig.formula}"
    yield "Symbols"
    yield from table([[k, d] for k, d in SYMBOLS_DOC.items()], indent=2)


SECTIONS = (
    _header,
    _pooling,
    _capacity,
    _memory,
    _other_memory,
    _transport,
    _compute,
    _projection,
    _dedup,
    _padding,
    _balance,
    _warnings,
)  # the report, in order (the formulas follow with --symbolic)


def render(pl: Plan, symbolic: bool = False) -> str:
    """The report: each section in turn, then with ``symbolic`` the formulas."""
    out = [line for section in SECTIONS for line in section(pl)]
    if symbolic:
        out += _formulas(pl)
    return "\n".join(out) + "\n"


__all__ = ["fmt", "fmt_bytes", "render", "table"]
