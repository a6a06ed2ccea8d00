"""The command line, in-process (rdepc.cli.main) and in a subprocess (python -m rdepc.cli)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, HANG_S, ROOT

import rdepc
from rdepc import cli

GOLDEN = ROOT / "tests" / "golden"
CORPUS = sorted((ROOT / "tests" / "corpus").glob("*.rdep"))
TWO_LAYERS = """layer small {
  shape  ranks 8, tokens 1024, hidden 512, experts 16, top 2
  expert swiglu(ffn = 256)
}
layer wide {
  shape  ranks 8, tokens 4096, hidden 2048, experts 64, top 6
  expert swiglu(ffn = 1408)
}
"""


def run(*args: str, cwd: Path = ROOT, **kw) -> subprocess.CompletedProcess:
    """python -m rdepc.cli ARGS, never with a traceback."""
    env = dict(os.environ, NO_COLOR="1")
    p = subprocess.run(
        [sys.executable, "-m", "rdepc.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
        **kw,
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p


def one_line_error(err: str, path: str, message: str) -> None:
    assert err.count("\n") == 1, err
    assert err == f"{path}:1:1: error: {message}\n"


# ------------------------------------------------------------------------ check


def test_check_every_example(main):
    status, out, err = main("check", *[f"examples/{p.name}" for p in EXAMPLES])
    assert status == 0
    assert "examples/tiny.rdep: layer tiny: ok (W=4 T=16 H=64 E=8 K=2, swiglu F=128)" in out.splitlines()
    assert len(out.splitlines()) == len(EXAMPLES)
    assert "examples/moonlight.rdep: layer moonlight: ok (W=8 T=4096 H=2048 E=64 K=6, swiglu F=1408)" in out
    # the one note of the examples, on stderr, with its excerpt
    assert err.startswith("examples/nvl72_e128.rdep:16:3: note: non-uniform ownership: 56 ranks own 2 experts")
    assert "   16 |   owner     balanced" in err


def test_check_symbolic_and_defines(main, tmp_path):
    spec = tmp_path / "sym.rdep"
    spec.write_text(
        "param T <= 8192\nlayer s {\n  shape ranks 8, tokens T, hidden 64, experts 8, top 2\n"
        "  expert swiglu(ffn = 64)\n}\n",
        encoding="utf-8",
    )
    status, out, _ = main("check", str(spec))
    assert (status, out) == (0, f"{spec}: layer s: ok (W=8 T<=8192 H=64 E=8 K=2, swiglu F=64)\n")
    status, out, _ = main("check", str(spec), "-D", "T=4096")
    assert (status, out) == (0, f"{spec}: layer s: ok (W=8 T=4096 H=64 E=8 K=2, swiglu F=64)\n")
    status, _, err = main("check", str(spec), "-D", "T=9000")
    assert status == 1
    assert f"{spec}:1:1: error: override T=9000 is outside 1..8192" in err


def test_check_werror(main):
    assert main("check", "--werror", "examples/tiny.rdep")[0] == 0
    # a note is not a warning: nvl72's non-uniform ownership note passes --werror
    status, out, err = main("check", "--werror", "examples/nvl72_e128.rdep")
    assert status == 0 and "note: non-uniform ownership" in err and "layer nvl72_e128: ok" in out
    # a warning fails it (capacity factor below 1)
    status, out, err = main("check", "--werror", "tests/corpus/91_warn_capacity_factor_below_one.rdep")
    assert status == 1 and "warning:" in err and out == ""


def test_check_reports_every_corpus_expectation(main):
    """One run over the whole corpus: every file's expected diagnostic, compiler-style."""
    paths = [str(p.relative_to(ROOT)) for p in CORPUS]
    status, out, err = main("check", *paths)
    assert status == 1
    for path in CORPUS:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        m = re.match(r"# expect(?: (warning|note))?: (\d+):(\d+): (.+)", first)
        sev = m[1] or "error"
        rel = path.relative_to(ROOT)
        assert f"{rel}:{m[2]}:{m[3]}: {sev}: {m[4]}" in err, rel
        if sev != "error":
            assert f"{rel}: layer m: ok (" in out


def test_check_error_output_has_excerpt_caret_and_hint(main, tmp_path):
    spec = tmp_path / "bad.rdep"
    spec.write_text(
        "layer m {\n  shape ranks 8, tokens 64, hidden 64, experts 8, top 2\n  expert swiglu(ffn = 64)\n"
        "  capacity factr 1.25\n}\n",
        encoding="utf-8",
    )
    status, out, err = main("check", str(spec))
    assert status == 1 and out == ""
    assert err.splitlines()[:3] == [
        f"{spec}:4:3: error: 'capacity' needs one of: dropless, factor F, rows N",
        "    4 |   capacity factr 1.25",
        "      |   ^~~~~~~~",
    ]
    assert f"{spec}:4:12: error: unknown option 'factr' in 'capacity'\n" in err
    assert "      |            ^~~~~\n  hint: did you mean 'factor'?" in err


def test_check_goes_on_after_a_bad_file(main, tmp_path):
    status, out, err = main("check", str(tmp_path / "missing.rdep"), "examples/tiny.rdep")
    assert status == 1
    assert out == "examples/tiny.rdep: layer tiny: ok (W=4 T=16 H=64 E=8 K=2, swiglu F=128)\n"
    one_line_error(err, str(tmp_path / "missing.rdep"), "no such file")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("dir", "is a directory, not a .rdep file"),
        (b"layer m {\x00}\n", "not a text file (NUL byte at offset 9)"),
        ("# caf\xe9\n".encode("latin-1"), "not UTF-8 text (invalid byte at offset 5)"),
        (b"", "file is empty: a spec needs at least one 'layer NAME { ... }'"),
    ],
    ids=["missing", "directory", "binary", "latin1", "empty"],
)
@pytest.mark.parametrize("command", ["check", "compile"])
def test_bad_input_files(main, tmp_path, content, message, command):
    path = tmp_path / "input.rdep"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    status, out, err = (
        main(command, str(path), "-o", str(tmp_path / "out")) if command == "compile" else main(command, str(path))
    )
    assert (status, out) == (1, "")
    one_line_error(err, str(path), message)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ usage


def test_usage_errors(main, tmp_path):
    two = tmp_path / "two.rdep"
    two.write_text(TWO_LAYERS, encoding="utf-8")
    cases = [
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        ((), "the following arguments are required: COMMAND"),
        (("check",), "the following arguments are required: FILE"),
        (("check", "examples/tiny.rdep", "-D", "T"), "rdepc: error: -D T: expected NAME=VALUE"),
        (("check", "examples/tiny.rdep", "-D", "T=abc"), "rdepc: error: -D T=abc: 'abc' is not a number"),
        (("check", "examples/tiny.rdep", "-D", "Q=3"), "rdepc: error: no parameter Q in examples/tiny.rdep"),
        (("compile", "examples/tiny.rdep", "-D", "Q=3"), "rdepc: error: no parameter Q in examples/tiny.rdep"),
        (("check", "examples/tiny.rdep", "--layer", "big"), "has no layer 'big' (it has: tiny)"),
        (("compile", "examples/tiny.rdep", "--layer", "big"), "has no layer 'big' (it has: tiny)"),
        (("compile", str(two)), f"{two} defines 2 layers (small, wide); choose one with --layer NAME"),
        (("compile", "examples/tiny.rdep", "--dump-after", "nosuchpass"), "--dump-after nosuchpass: no such pass"),
        (("check", "--no-such-flag", "examples/tiny.rdep"), "unrecognized arguments: --no-such-flag"),
    ]
    for argv, message in cases:
        status, out, err = main(*argv)
        assert status == 2, argv
        assert out == "", argv
        assert message in err, (argv, err)
        assert err.count("rdepc: error:") == 1 or "usage:" in err, err


def test_several_layers(main, tmp_path):
    two = tmp_path / "two.rdep"
    two.write_text(TWO_LAYERS, encoding="utf-8")
    status, out, _ = main("check", str(two))
    assert status == 0 and [line.split(": ")[1] for line in out.splitlines()] == ["layer small", "layer wide"]
    status, out, _ = main("check", str(two), "--layer", "wide")
    assert status == 0 and out.count("\n") == 1 and "layer wide: ok" in out
    status, out, _ = main("compile", str(two), "--layer", "small", "-o", str(tmp_path / "o"))
    assert status == 0 and json.loads((tmp_path / "o" / "small.spec.json").read_text())["shape"]["E"] == 16


def test_version_and_help(main):
    status, out, _ = main("--version")
    assert (status, out) == (0, f"rdepc {rdepc.__version__}\n")
    status, out, _ = main("--help")
    assert status == 0 and out.startswith("usage: rdepc")
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert {"check", "compile"} <= set(sub.choices)
    for name in sub.choices:
        status, out, err = main(name, "--help")
        assert status == 0 and err == ""
        assert out.startswith(f"usage: rdepc {name}")
        if name in ("check", "compile"):
            assert "--layer" in out and "-D NAME=VALUE" in out


def test_internal_errors_are_reported_as_such(main, monkeypatch):
    def boom(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "cmd_check", boom)
    status, _, err = main("check", "examples/tiny.rdep")
    assert status == 3
    assert err == "rdepc: internal error: RuntimeError: boom (run with --debug for a traceback)\n"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["--debug", "check", "examples/tiny.rdep"])


# ---------------------------------------------------------------------- compile


def test_compile_writes_the_golden_spec(main, tmp_path):
    status, out, err = main("compile", "examples/tiny.rdep", "-o", str(tmp_path))
    assert status == 0 and err == ""
    target = tmp_path / "tiny.spec.json"
    module = ["tiny.spec.json", "tiny_kernels.py", "tiny.contract.json", "tiny.py"]  # the spec, then the module
    assert out == "".join(f"wrote {tmp_path / name}\n" for name in module)
    assert target.read_text(encoding="utf-8") == (GOLDEN / "tiny.json").read_text(encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(module)  # no temporary left behind


def test_compile_default_output_dir(main, tmp_path, monkeypatch):
    (tmp_path / "tiny.rdep").write_text((ROOT / "examples" / "tiny.rdep").read_text(), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    status, out, _ = main("compile", "tiny.rdep")
    assert status == 0 and out.startswith(f"wrote {Path('build', 'tiny', 'tiny.spec.json')}\n")
    assert json.loads((tmp_path / "build" / "tiny" / "tiny.spec.json").read_text())["layer"] == "tiny"


def test_compile_overrides_and_warnings(main, tmp_path):
    status, _, err = main("compile", "examples/nvl72_e128.rdep", "-D", "T=2048", "-o", str(tmp_path))
    assert status == 0
    data = json.loads((tmp_path / "nvl72_e128.spec.json").read_text())
    assert data["shape"]["T"] == 2048 and data["params"]["T"]["overridden"] is True
    assert data["capacity"]["rows_per_expert"] == 8640
    assert "note: non-uniform ownership" in err


NVSHMEM_ON_EMULATED = (
    "{spec}:17:3: warning: 'transport nvshmem' compiled for the {backend} backend: rows move through the emulated "
    "symmetric heap, not NVSHMEM\n"
    "  hint: --backend nvshmem builds the spec's target (one process per GPU rank, under torchrun)\n"
)


def _tiny_on_nvshmem(tmp_path: Path) -> Path:
    spec = tmp_path / "nv.rdep"
    text = (ROOT / "examples" / "tiny.rdep").read_text(encoding="utf-8").replace("emulated", "nvshmem")
    assert text.splitlines()[16] == "  transport nvshmem"  # line 17, col 3
    spec.write_text(text, encoding="utf-8")
    return spec


def test_transport_nvshmem_compiled_for_an_emulated_backend_warns(main, tmp_path):
    """The backend is known to compile and run, not to check: they warn at the transport
    statement that the spec's nvshmem target is not what the kernels are built for."""
    spec = _tiny_on_nvshmem(tmp_path)
    status, out, err = main("compile", str(spec), "-o", str(tmp_path / "a"))
    assert status == 0 and err == NVSHMEM_ON_EMULATED.format(spec=spec, backend="emulated")
    assert "wrote" in out
    status, _, err = main("compile", str(spec), "-o", str(tmp_path / "b"), "--backend", "emulated-mp")
    assert status == 0 and err == NVSHMEM_ON_EMULATED.format(spec=spec, backend="emulated-mp")
    status, _, err = main("compile", str(spec), "-o", str(tmp_path / "c"), "--backend", "nvshmem")
    assert (status, err) == (0, "")
    status, _, err = main("check", "--werror", str(spec))  # no backend: nothing to say
    assert (status, err) == (0, "")


def test_transport_nvshmem_run_on_the_emulated_backend_warns(main, tmp_path):
    spec = _tiny_on_nvshmem(tmp_path)
    status, out, err = main("run", str(spec), "--check")
    assert status == 0 and out.rstrip().endswith("check passed")
    assert err == NVSHMEM_ON_EMULATED.format(spec=spec, backend="emulated")


def test_backend_warnings():
    from rdepc.driver import backend_warnings

    nvshmem = rdepc.load(ROOT / "examples/moonlight.rdep").spec
    (w,) = backend_warnings(nvshmem, "emulated-mp")
    assert (w.span.line, w.span.col) == (24, 3)
    assert w.message.startswith("'transport nvshmem' compiled for the emulated-mp backend: ")
    assert backend_warnings(nvshmem, "nvshmem") == ()
    assert backend_warnings(nvshmem, "tcp") == ()  # an unknown backend is refused by its caller
    assert backend_warnings(rdepc.load(ROOT / "examples/tiny.rdep").spec, "emulated") == ()  # transport emulated


def test_compile_errors(main, tmp_path):
    bad = tmp_path / "bad.rdep"
    bad.write_text("layer m {\n  shape ranks 8\n  expert swiglu(ffn = 8)\n}\n", encoding="utf-8")
    status, out, err = main("compile", str(bad), "-o", str(tmp_path / "o"))
    assert (status, out) == (1, "")
    assert err.startswith(f"{bad}:2:3: error: 'shape' is missing tokens, hidden, experts, top\n")
    assert not (tmp_path / "o").exists()


def test_compile_into_a_file_is_an_error_not_a_crash(main, tmp_path):
    """Regression: -o naming an existing file was an internal error (FileExistsError)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, out, err = main("compile", "examples/tiny.rdep", "-o", str(blocker))
    assert (status, out) == (1, "")
    assert err == f"rdepc: error: cannot write {blocker}: File exists\n"
    status, _, err = main("compile", "examples/tiny.rdep", "-o", str(blocker / "sub"))
    assert status == 1 and err.startswith("rdepc: error: cannot write ") and err.count("\n") == 1


def test_dump_after_and_time_passes(main, tmp_path):
    status, out, _ = main("compile", "examples/tiny.rdep", "-o", str(tmp_path), "--dump-after", "elaborate")
    assert status == 0
    head, _, rest = out.partition("\n")
    assert head == "// ----- IR after elaborate"
    dumped, _, tail = rest.rpartition("}\n")
    assert json.loads(dumped + "}") == json.loads((GOLDEN / "tiny.json").read_text())
    assert tail.startswith(f"wrote {tmp_path / 'tiny.spec.json'}\n")

    status, out, _ = main("compile", "examples/tiny.rdep", "-o", str(tmp_path), "--dump-after", "parse")
    assert status == 0
    assert out.splitlines()[:3] == [
        "// ----- IR after parse",
        "module examples/tiny.rdep",
        "  param W at examples/tiny.rdep:3:1",
    ]
    assert "  layer tiny at examples/tiny.rdep:8:7" in out

    status, out, _ = main("compile", "examples/tiny.rdep", "-o", str(tmp_path), "--time-passes")
    assert status == 0
    lines = out.splitlines()
    start = lines.index("// pass timings")
    names = [line.split()[1] for line in lines[start + 1 :] if line.startswith("//   ")]
    assert names[:2] == ["parse", "elaborate"] and names[-1] == "total"
    for line in lines[start + 1 : start + 1 + len(names)]:
        assert re.fullmatch(r"//   \S+ +\d+\.\d\d ms", line), line


# ------------------------------------------------------------------- subprocesses


def test_subprocess_check_and_exit_codes(tmp_path):
    p = run("check", *[f"examples/{e.name}" for e in EXAMPLES])
    assert p.returncode == 0 and p.stdout.count(": ok (") == len(EXAMPLES)
    p = run("check", str(tmp_path / "missing.rdep"))
    assert p.returncode == 1 and p.stderr == f"{tmp_path / 'missing.rdep'}:1:1: error: no such file\n"
    p = run("frobnicate")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run("--version")
    assert (p.returncode, p.stdout) == (0, f"rdepc {rdepc.__version__}\n")


def test_subprocess_compile_matches_golden(tmp_path):
    p = run("compile", "examples/tiny.rdep", "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "tiny.spec.json").read_text() == (GOLDEN / "tiny.json").read_text()


def test_entry_point_script(tmp_path):
    script = Path(sys.executable).parent / "rdepc"
    if not script.exists():
        pytest.skip("the rdepc console script is not installed next to this Python")
    p = subprocess.run([str(script), "check", "examples/tiny.rdep"], cwd=ROOT, capture_output=True, text=True)
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout == "examples/tiny.rdep: layer tiny: ok (W=4 T=16 H=64 E=8 K=2, swiglu F=128)\n"
    p = subprocess.run([str(script), "check", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr


def test_check_imports_neither_torch_triton_nor_sympy():
    code = (
        "import sys\n"
        "from rdepc.cli import main\n"
        "status = main(['check', 'examples/moonlight.rdep', 'examples/nvl72_e128.rdep'])\n"
        "print(status, sorted(m for m in ('torch', 'triton', 'sympy') if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "0 []"


def test_broken_pipe_is_not_an_internal_error(tmp_path):
    """Regression: 'rdepc compile --dump-after ... | head' reported an internal BrokenPipeError."""
    argv = ["compile", "examples/tiny.rdep", "--dump-after", "elaborate", "-o", str(tmp_path)]
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        p = subprocess.run(
            [sys.executable, "-m", "rdepc.cli", *argv],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=HANG_S,
        )
    finally:
        os.close(write_end)
    assert p.returncode == 1
    assert p.stderr == ""


def test_one_owning_rank_is_said_in_the_singular(main):
    """'1 rank owns 8', never '1 ranks own 8': in the plan's pooling table and the ownership note."""
    status, out, _ = main("plan", "examples/tiny.rdep", "-D", "W=1")
    assert status == 0 and "1 rank owns 8" in out and "1 ranks" not in out
    from rdepc.diagnostics import owning

    assert (owning(1, "2 experts"), owning(3, 1)) == ("1 rank owns 2 experts", "3 ranks own 1")
