"""What rdepc needs of its environment, refused in one line before any work: a torch that can
reach a GPU for ``device="cuda"``, and a compilation cache it can write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from rdepc.runtime import cache

import rdepc
from rdepc.api import UsageError, check_device

TINY = ROOT / "examples" / "tiny.rdep"
ROOT_USER = os.geteuid() == 0  # root ignores file modes: the chmod cases cannot fail for it
INTERP = "the Triton interpreter: rdepc sets TRITON_INTERPRET=1"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "rdepc-cache"
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(d))
    return d


@pytest.fixture
def cpu_only(monkeypatch):
    """This torch as a CPU-only build, whatever it is."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)


# --- device="cuda" -------------------------------------------------------------------------------


def cpu_only_message(what: str, instead: str) -> str:
    return (
        f"{what}: this torch ({torch.__version__}) is a CPU-only build, without CUDA; "
        f"use {instead} or install a CUDA build of torch"
    )


@pytest.mark.parametrize(
    ("device", "name"), [("cuda", '"cuda"'), ("cuda:1", '"cuda:1"'), (torch.device("cuda", 0), '"cuda:0"'), (0, "0")]
)
def test_cuda_on_a_cpu_only_torch_is_a_usage_error_before_compiling(cpu_only, cache_dir, device, name):
    layer = rdepc.load(TINY)
    with pytest.raises(UsageError) as e:
        layer.module(device=device)
    assert str(e.value) == cpu_only_message(f"device {name}", f'device="cpu" ({INTERP})')
    assert not cache_dir.exists()  # nothing compiled


def test_rdepmoe_on_a_cpu_only_torch(cpu_only, cache_dir):
    with pytest.raises(UsageError) as e:
        rdepc.RDEPMoE(TINY, device="cuda")
    assert str(e.value) == cpu_only_message('device "cuda"', f'device="cpu" ({INTERP})')
    assert not cache_dir.exists()


def test_cuda_build_without_a_visible_gpu(monkeypatch, cache_dir):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError) as e:
        rdepc.RDEPMoE(TINY, device="cuda")
    assert str(e.value) == (
        f'device "cuda": this torch ({torch.__version__}, CUDA 12.8) sees no GPU; use device="cpu" ({INTERP}), '
        "or check the driver and CUDA_VISIBLE_DEVICES"
    )


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_other_devices_pass_the_check(cpu_only, device):
    check_device(device)  # "meta" and other non-CUDA devices: RDEPModule says what it accepts


def test_cli_run_device_cuda_on_a_cpu_only_torch(cpu_only, cache_dir, main, monkeypatch):
    from rdepc import parser

    def no_parse(*a, **k):
        raise AssertionError("parsed before the device check")

    monkeypatch.setattr(parser, "parse_file", no_parse)
    status, out, err = main("run", str(TINY), "--device", "cuda")
    assert (status, out) == (2, "")
    assert err == "rdepc: error: " + cpu_only_message("--device cuda", f"--device cpu ({INTERP})") + "\n"
    assert not cache_dir.exists()


# --- the compilation cache -----------------------------------------------------------------------


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("", encoding="utf-8")
    for d in (f, f / "sub"):  # the file itself, or a path under it
        monkeypatch.setenv("RDEPC_CACHE_DIR", str(d))
        with pytest.raises(cache.CacheError) as e:
            rdepc.load(TINY).compile()
        assert isinstance(e.value, UsageError) and not isinstance(e.value, OSError)
        assert str(e.value) == (
            f"cannot use the compilation cache RDEPC_CACHE_DIR={d}: {f} is a file, not a directory; "
            "set RDEPC_CACHE_DIR to a writable directory"
        )


def test_cache_is_checked_before_compiling(tmp_path, monkeypatch):
    from rdepc import driver

    def no_codegen(*a, **k):
        raise AssertionError("compiled before the cache check")

    monkeypatch.setattr(driver, "generate_spec", no_codegen)
    (tmp_path / "file").write_text("", encoding="utf-8")
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(cache.CacheError, match="is a file, not a directory"):
        rdepc.load(TINY).compile()


def test_default_cache_under_a_home_that_is_a_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("", encoding="utf-8")
    monkeypatch.delenv("RDEPC_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(cache.CacheError) as e:
        rdepc.load(TINY).compile()
    assert str(e.value) == (
        f"cannot use the compilation cache {home / '.cache' / 'rdepc'} (RDEPC_CACHE_DIR is unset: the default "
        f"under HOME={home}): {home} is a file, not a directory; set RDEPC_CACHE_DIR to a writable directory, "
        "or point HOME at a writable directory"
    )


def test_no_home_directory(monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("RDEPC_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(cache.CacheError) as e:
        rdepc.load(TINY).compile()
    assert str(e.value) == (
        "cannot find a home directory for the compilation cache (HOME is unset); "
        "set RDEPC_CACHE_DIR to a writable directory"
    )


@pytest.mark.skipif(ROOT_USER, reason="root ignores file modes")
def test_cache_dir_without_write_permission(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        for d in (ro, ro / "sub"):
            monkeypatch.setenv("RDEPC_CACHE_DIR", str(d))
            with pytest.raises(cache.CacheError) as e:
                rdepc.load(TINY).compile()
            assert str(e.value) == (
                f"cannot use the compilation cache RDEPC_CACHE_DIR={d}: {ro} is not writable; "
                "set RDEPC_CACHE_DIR to a writable directory"
            )
    finally:
        ro.chmod(0o755)


@pytest.mark.skipif(ROOT_USER, reason="root ignores file modes")
def test_default_cache_under_an_unwritable_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    monkeypatch.delenv("RDEPC_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    try:
        with pytest.raises(cache.CacheError) as e:
            rdepc.load(TINY).compile()
    finally:
        home.chmod(0o755)
    assert str(e.value) == (
        f"cannot use the compilation cache {home / '.cache' / 'rdepc'} (RDEPC_CACHE_DIR is unset: the default "
        f"under HOME={home}): {home} is not writable; set RDEPC_CACHE_DIR to a writable directory, "
        "or point HOME at a writable directory"
    )


def test_unwritable_cache_refuses_a_miss_and_serves_a_hit(cache_dir, monkeypatch):
    """Write permission as os.access reports it (so that this runs as root too)."""
    rdepc.load(TINY).compile()  # the entry is there
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == cache_dir else real(p, mode))
    assert rdepc.load(TINY).compile().hit  # a read-only cache still serves what it holds
    with pytest.raises(cache.CacheError) as e:
        rdepc.load(TINY, T=8).compile()
    assert str(e.value) == (
        f"cannot use the compilation cache RDEPC_CACHE_DIR={cache_dir}: {cache_dir} is not writable; "
        "set RDEPC_CACHE_DIR to a writable directory"
    )


def test_cli_run_with_an_unusable_cache(tmp_path, monkeypatch, main):
    f = tmp_path / "file"
    f.write_text("", encoding="utf-8")
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(f / "sub"))
    status, out, err = main("run", str(TINY))
    assert (status, out) == (2, "")
    assert err == (
        f"rdepc: error: cannot use the compilation cache RDEPC_CACHE_DIR={f / 'sub'}: {f} is a file, "
        "not a directory; set RDEPC_CACHE_DIR to a writable directory\n"
    )
