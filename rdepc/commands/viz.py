"""``rdepc viz``: a layer's predicted schedule as a summary, a Chrome/Perfetto trace, a Gantt
chart and a Graphviz graph (``rdepc.viz``). Imports neither torch nor triton."""

from __future__ import annotations

import sys

from rdepc.api import UsageError
from rdepc.commands.common import load_spec


def cmd_viz(args) -> int:
    from rdepc.passes.lowering import lowering_line
    from rdepc.passes.replicate import without_replication
    from rdepc.passes.resolve import build_for, choice_warnings
    from rdepc.passes.schedule import report, schedule

    spec = load_spec(args)
    if args.ranks < 1:
        raise UsageError(f"--ranks {args.ranks}: expected a positive number")
    replicated = spec.balance.kind == "replicate"
    # the layer without replication: what a routing is sampled for, and the comparison
    gemm = None if args.gemm in (None, "auto") else args.gemm
    tg = build_for(without_replication(spec) if replicated else spec, args.schedule, args.cut, args.hw, gemm)
    counts = None
    if args.routing:  # strategy and cut as compile resolves them; split, order and timeline under this routing
        from rdepc.passes.sampled_routing import source_counts

        geo = tg.geometry
        counts = source_counts(geo.W, geo.T, geo.E, geo.K, *args.routing, args.seed)
        per_expert = [sum(c) for c in zip(*counts, strict=True)]
        name = "uniform" if args.routing[0] == "uniform" else f"zipf alpha={args.routing[1]:g}"
        print(
            f"routing: {name}, seed {args.seed}, one sampled routing (rows per expert {min(per_expert):,} to "
            f"{max(per_expert):,}, mean {sum(per_expert) / len(per_expert):,.1f}, before capacity)"
        )
    unreplicated, layer, held = None, spec, None
    if replicated:
        if counts is None:
            print("balance: replicate; the balanced owners need a routing (--routing uniform or zipf:ALPHA): "
                  "the timeline is the layer's without replication")  # fmt: skip
        else:  # the physical layer under the plan for this routing, beside the layer without replication
            tg, counts, unreplicated, held = _balanced(spec, args, tg, counts)
            layer = tg.spec
    sched = schedule(tg, args.hw, counts=counts, held=held)
    print(report(sched))
    print(f"  decision        {lowering_line(sched, gemm)}")
    for w in choice_warnings(spec, args.schedule, args.cut, args.hw, gemm):
        print(f"  warning         {w}")
    if unreplicated is not None:
        pushes = [t for t in tg.tasks if t.detail == "push"]
        busiest = max(pushes, key=lambda t: (sched.cost.link_bytes[t.id], -t.rank))
        took = sched.end[busiest.id] - sched.start[busiest.id]
        print(
            f"  weight pushes   {took * 1e6:,.1f} µs on rank {busiest.rank}, the busiest "
            f"({sched.cost.link_bytes[busiest.id]:,} B of its replicas' weights), tasks of the layer beside its "
            "route and dispatch"
        )
        loads = [sched.start[t.id] for t in tg.tasks if t.detail == "load"]
        planned = max(sched.end[t.id] for t in tg.tasks if t.detail == "reroute") - min(loads)
        print(f"  plan            {planned * 1e6:,.1f} µs until the last rank's rows are rerouted (the loads' "
              "exchange, the solve and the reroute: tasks of the layer before its route)")  # fmt: skip
        print(f"  unreplicated    {unreplicated.makespan * 1e6:,.1f} µs predicted without replication, for comparison")
    from rdepc import viz

    wrote = []
    try:
        if args.trace:
            wrote.append(viz.write_trace(sched, args.trace, empty=args.empty))
        if args.png:
            bulk = None
            if sched.strategy != "bulk":
                bulk = schedule(build_for(layer, "bulk", None, args.hw), args.hw, counts=counts, held=held)
                print(f"  bulk            {bulk.makespan * 1e6:,.1f} µs predicted (no overlap), for comparison")
            wrote.append(viz.write_png(sched, args.png, bulk=bulk, max_ranks=args.ranks, unreplicated=unreplicated))
        if args.dot:
            try:
                level = "tiles" if args.full else "tasks" if args.tasks else "stages"
                wrote.append(viz.write_dot(sched.graph, args.dot, sched=sched, level=level))
            except ValueError as e:  # --full on a spec too large for a tile graph
                raise UsageError(f"--dot --full: {e}") from None
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"rdepc: error: cannot write {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
    for path in wrote:
        print(f"wrote {path}")
    return 0


def _balanced(spec, args, tg, counts):
    """(the physical layer's graph, its rows per (source, physical expert) under the plan for
    ``counts``, the schedule of the layer without replication, the home expert in each slot
    under that plan), and the plan's figures printed."""
    from rdepc.ir.balance import imbalance, owner_loads
    from rdepc.passes.replicate import physical_counts, physical_layer
    from rdepc.passes.resolve import build_for
    from rdepc.passes.schedule import schedule

    phys, plan = physical_counts(spec, counts)
    before = owner_loads(counts, spec.ownership.owner).tolist()
    after = plan.rank_loads.tolist()
    held = [[int(e) for e in row] for row in plan.slots]
    print(
        f"balance: max/mean {imbalance(before):.3f} before, {imbalance(after):.3f} after (rows per rank {before} -> "
        f"{after}; replicas per rank {[[e for e in row if e >= 0] for row in held]}); the timeline is the "
        "physical layer's under this plan, the plan and its weight pushes tasks of the layer"
    )
    unreplicated = schedule(tg, args.hw, counts=counts)
    return build_for(physical_layer(spec), args.schedule, args.cut, args.hw), phys, unreplicated, held
