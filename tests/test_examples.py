"""Every example runs: ``rdepc run examples/X.rdep --check`` under the Triton interpreter,
narrowed through the examples' own parameters (H, F and, for the widest, E or W) so that
a run takes seconds. The routing, ownership, capacity policy, schedule, segmentation and
dispatch dtype stay the spec's."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, ROOT, TORCH_APART

# -D overrides per example; T is the bound the plan sizes buffers for, the run uses all of it.
NARROW = {
    "tiny": (),
    "tiny_balance": (),  # balance replicate: 1 slot a rank
    "moonlight": ("T=8", "H=64", "F=64"),
    "mixtral_8x7b": ("T=8", "H=64", "F=64"),
    "qwen3_30b_a3b": ("T=8", "E=32", "H=64", "F=64"),  # 4 experts a rank
    "deepseek_v3": ("T=8", "E=16", "H=128", "F=64"),  # fp8 dispatch, one scale per row
    "deepseek_v2": ("T=8", "E=16", "H=64", "F=64"),  # 8 groups of 2: the best 3 hold K = 6
    "qwen2_moe": ("T=8", "H=64", "F=64", "FS=64"),  # the gated shared expert at 64 too
    "gpt_oss_120b": ("T=8", "E=16", "H=64", "F=64"),
    # 4 ranks keep these short: what sets them apart is not the number of ranks (Qwen3-Next's top-10
    # and gated shared expert, Llama-4's gate on the expert's input, Ernie's and HunYuan's routers and
    # shared experts)
    "qwen3_next_80b_a3b": ("W=4", "T=8", "E=16", "H=64", "F=64", "FS=64"),
    "llama4_scout": ("W=4", "T=8", "H=64", "F=64", "FS=64"),
    "ernie45_21b_a3b": ("W=4", "T=8", "E=16", "H=64", "F=64"),
    "hunyuan_a13b": ("W=4", "T=8", "E=16", "H=64", "F=64", "FS=64"),
    # 72 ranks put 10,800 entries in the task table (about 4 minutes in the interpreter at
    # T=2); 12 ranks keep E = 128 unevenly owned (8 ranks own 11 experts, 4 own 10), top-2.
    "nvl72_e128": ("W=12", "T=4", "K=2", "H=64", "F=64"),
}


def test_every_example_is_narrowed():
    assert sorted(NARROW) == sorted(p.stem for p in EXAMPLES)


@pytest.mark.parametrize("example", sorted(NARROW))
def test_example_runs_and_checks(example, main):
    argv = ["run", f"examples/{example}.rdep", "--check"]
    for d in NARROW[example]:
        argv += ["-D", d]
    status, out, err = main(*argv)
    assert status == 0, err
    assert out.rstrip().endswith("check passed")
    assert "max rel. error" in out and "redundancy" in out


@pytest.mark.parametrize("example", sorted(set(NARROW) - TORCH_APART))
def test_example_runs_and_checks_through_the_library_gemms(example, main):
    """Every example but TORCH_APART (what sets those apart is torch, in either lowering, and
    runs in test_example_runs_and_checks) with its GEMMs through torch's grouped GEMM, bulk,
    phased (its own strategy set aside)."""
    argv = ["run", f"examples/{example}.rdep", "--check", "--gemm", "library"]
    for d in NARROW[example]:
        argv += ["-D", d]
    status, out, err = main(*argv)
    assert status == 0, err
    assert "the library's grouped GEMMs" in out and "  gemm            library: given" in out
    assert out.rstrip().endswith("check passed")


def test_the_language_docs_in_brief_block_is_the_moonlight_example():
    docs = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    assert "\n## In brief\n\n```\n" in docs, "docs/language.md lost its 'In brief' section"
    block = docs.split("\n## In brief\n\n```\n", 1)[1].split("```\n", 1)[0]
    assert block == (ROOT / "examples" / "moonlight.rdep").read_text(encoding="utf-8")


def test_the_language_docs_complete_example_is_the_moonlight_example():
    docs = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    block = docs.split("## 7. A complete example", 1)[1].split("```rdep\n", 1)[1].split("```\n", 1)[0]
    spec = (ROOT / "examples" / "moonlight.rdep").read_text(encoding="utf-8")
    assert block == "".join(line for line in spec.splitlines(keepends=True) if not line.startswith("#"))
