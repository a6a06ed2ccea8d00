"""Random small MoE layers and routings for the graph, schedule and memory-plan tests.

Specs are built as .rdep text and loaded through the parser and elaboration, like a
user's. The row-level simulation here is written independently of
``rdepc.passes.loads.segment_load`` (which works on counts), so the tests can hold one
against the other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st

from rdepc.api import load_text
from rdepc.ir.sizes import BM


def layer_text(c, *, schedule: str, sideband: str | None = None, segment: str | None = None) -> str:
    """The .rdep text of layer ``t``: ``c``'s sizes (W, T, H, E, K, F) and policies (act,
    dtype, owner, capacity), and the statements given; the tests' layers are written by it."""
    lines = [
        f"shape     ranks {c.W}, tokens {c.T}, hidden {c.H}, experts {c.E}, top {c.K}",
        f"expert    {c.act}(ffn = {c.F})",
        f"dtype     {c.dtype}",
        *([f"sideband  {sideband}"] if sideband else []),
        f"owner     {c.owner}",
        f"capacity  {c.capacity}",
        *([f"segment   {segment}"] if segment else []),
        f"schedule  {schedule}",
    ]
    return "layer t {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


@dataclass(frozen=True)
class Case:
    W: int
    T: int
    H: int
    E: int
    K: int
    F: int = 32
    S: int = 64
    B: int = 2
    cut: str = "expert"
    capacity: str = "dropless"
    owner: str = "balanced"
    act: str = "swiglu"
    dtype: str = "bf16"
    schedule: str = "pipelined"

    def text(self) -> str:
        return layer_text(
            self,
            sideband="row_id, local_expert, gate",
            segment=f"rows {self.S}, buffers {self.B}, cut {self.cut}",
            schedule=self.schedule,
        )

    def spec(self):
        return load_text(self.text(), file="case.rdep").spec


@st.composite
def cases(draw, max_W: int = 4) -> Case:
    W = draw(st.integers(1, max_W))
    per = draw(st.integers(1, 3))
    uneven = draw(st.booleans()) and W > 1
    E = W * per + (draw(st.integers(1, W - 1)) if uneven else 0)
    owner = "balanced"
    if draw(st.booleans()) and W > 1 and E >= 2:
        # A non-uniform map: rank 0 owns a random share, the rest round-robin; maybe one rank owns none.
        idle = draw(st.booleans()) and W > 2
        ranks = [q for q in range(W) if not (idle and q == W - 1)]
        first = draw(st.integers(1, max(1, E - len(ranks) + 1)))
        assign = {q: [] for q in ranks}
        assign[0] = list(range(first))
        for i, e in enumerate(range(first, E)):
            assign[ranks[1 + i % (len(ranks) - 1)] if len(ranks) > 1 else 0].append(e)
        parts = [f"{q}: {', '.join(map(str, es))}" for q, es in assign.items() if es]
        owner = "map { " + "; ".join(parts) + " }"
    K = draw(st.integers(1, min(E, 4)))
    T = draw(st.integers(1, 40))
    S = draw(st.sampled_from([3, 8, 17, 32, 64, 100, 256]))
    B = draw(st.sampled_from([2, 2, 3]))
    cap = draw(st.sampled_from(["dropless", "factor 1.0", "factor 0.5", "rows 3", "factor 1.25"]))
    return Case(
        W=W,
        T=T,
        H=draw(st.sampled_from([8, 64, 512])),
        E=E,
        K=K,
        F=draw(st.sampled_from([16, 64, 256])),
        S=S,
        B=B,
        cut=draw(st.sampled_from(["expert", "source"])),
        capacity=cap,
        owner=owner,
        act=draw(st.sampled_from(["swiglu", "swiglu", "gelu"])),
    )


def routing(case: Case, kind: str, seed: int) -> list[list[tuple[int, ...]]]:
    """routing[r][t] = the K distinct experts token t of rank r picks, in slot order."""
    rng = random.Random(seed)
    E, K = case.E, case.K
    spec_owner = None
    out = []
    for _r in range(case.W):
        rows = []
        for _t in range(case.T):
            if kind == "one":  # every row to expert 0 (and the fewest others distinct top-K allows)
                picks = [0, *rng.sample(range(1, E), K - 1)] if K > 1 else [0]
            elif kind == "hot":  # Zipf-like: low expert ids far more popular
                weights = [1.0 / (e + 1) ** 1.5 for e in range(E)]
                picks = []
                while len(picks) < K:
                    e = rng.choices(range(E), weights)[0]
                    if e not in picks:
                        picks.append(e)
            elif kind == "skip":  # the last owner receives nothing, when top-K allows it
                if spec_owner is None:
                    spec_owner = case.spec().ownership.owner
                avoid = {e for e in range(E) if spec_owner[e] == max(spec_owner)}
                pool = [e for e in range(E) if e not in avoid]
                picks = rng.sample(pool, K) if len(pool) >= K else rng.sample(range(E), K)
            else:
                picks = rng.sample(range(E), K)
            rows.append(tuple(picks))
        out.append(rows)
    return out


def counts(case: Case, route) -> list[list[int]]:
    c = [[0] * case.E for _ in range(case.W)]
    for r, toks in enumerate(route):
        for picks in toks:
            for e in picks:
                c[r][e] += 1
    return c


def place_rows(geo, route) -> dict:
    """Row-level placement, independent of segment_load: admitted rows (round_robin: token
    index, then the rank's turn (r − t) mod W, then slot; arrival: row_id order, eq. 7), each
    owner's receive order, segments of S rows. Returns
    {"admitted": set of (r, t, k), "where": {(r, t, k): (q, s, e)}, "dropped": set}."""
    rows = []
    for r, toks in enumerate(route):
        for t, picks in enumerate(toks):
            for k, e in enumerate(picks):
                rows.append((r, t, k, e))
    if geo.drop == "round_robin":
        rows.sort(key=lambda x: (x[1], (x[0] - x[1]) % geo.W, x[2]))
    else:
        rows.sort(key=lambda x: (x[0] * geo.T + x[1]) * geo.K + x[2])  # row_id order
    taken = [0] * geo.E
    admitted, dropped = [], set()
    for r, t, k, e in rows:
        if geo.cap_e is None or taken[e] < geo.cap_e:
            taken[e] += 1
            admitted.append((r, t, k, e))
        else:
            dropped.add((r, t, k))
    where = {}
    for q in range(geo.W):
        mine = [x for x in admitted if geo.owner[x[3]] == q]
        rot = [(x[0] - q) % geo.W for x in mine]
        if geo.cut == "expert":
            keyed = sorted(zip(mine, rot, strict=True), key=lambda p: (geo.local[p[0][3]], p[1], p[0][1], p[0][2]))
        else:
            keyed = sorted(zip(mine, rot, strict=True), key=lambda p: (p[1], geo.local[p[0][3]], p[0][1], p[0][2]))
        for pos, (x, _) in enumerate(keyed):
            where[(x[0], x[1], x[2])] = (q, pos // geo.S, x[3])
    return {"admitted": {(r, t, k) for r, t, k, _ in admitted}, "where": where, "dropped": dropped}


def m_tiles(rows_by_expert: dict[int, int]) -> int:
    return sum(-(-n // BM) for n in rows_by_expert.values())


ROUTING_KINDS = ("uniform", "hot", "one", "skip")

# The corner cases every property test runs, whatever hypothesis draws.
CORNERS = {
    "W=1": Case(W=1, T=13, H=8, E=3, K=2, S=8),
    "E_loc=1": Case(W=4, T=9, H=8, E=4, K=2, S=5, cut="source"),
    "K=E": Case(W=2, T=7, H=8, E=4, K=4, S=6),
    "T not a multiple of BM": Case(W=2, T=BM + 3, H=8, E=4, K=2, S=64),
    "capacity binds": Case(W=3, T=20, H=8, E=6, K=2, S=7, capacity="factor 0.5"),
    "non-uniform map": Case(W=3, T=11, H=8, E=5, K=2, S=4, owner="map { 0: 0, 1, 2; 1: 3; 2: 4 }"),
    "owner of nothing": Case(W=3, T=10, H=8, E=4, K=2, S=4, owner="map { 0: 0, 1; 1: 2, 3 }"),
    "deep": Case(W=2, T=30, H=8, E=4, K=2, S=8, B=3, schedule="deep"),
}
