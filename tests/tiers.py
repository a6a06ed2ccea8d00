"""The suite in tiers: every test file belongs to one, by what it runs, and ``pytest -m TIER``
runs that tier alone (conftest.py marks each test with its file's tier). The edit-test loop
runs the fast three; CI runs them all (docs/testing.md).

    pytest -m "unit or golden or property"     # the fast tiers: no kernel runs
    pytest -m interpreter                      # kernels under the Triton interpreter, one process
    pytest -m multiprocess                     # one OS process per rank, subprocesses, other toolchains
    pytest -m sm90                             # kernels compiled to sm_90 cubins (no GPU needed)
"""

TIERS: dict[str, tuple[str, ...]] = {
    # the front end, the passes and the commands that run no kernel
    "unit": (
        "test_api", "test_cli", "test_docs", "test_driver", "test_elaborate", "test_elaborate_statements",
        "test_interface", "test_layers", "test_parser", "test_plan", "test_plan_capacity", "test_plan_heap",
        "test_reference", "test_sizes", "test_style", "test_viz",
    ),
    # generated source and printed plans against the committed goldens, each pass's dump checked
    "golden": ("test_codegen", "test_dumps", "test_golden"),
    # hypothesis: schedules, memory plans and specs drawn at random and checked
    "property": ("test_fuzz", "test_graph", "test_memplan", "test_schedule", "test_spec_fuzz"),
    # kernels run under the Triton interpreter, every rank in one process
    "interpreter": (
        "test_admission", "test_backward", "test_bad_inputs", "test_balance", "test_bench", "test_cache",
        "test_cuda", "test_dedup", "test_device", "test_device_functions", "test_device_rows", "test_device_runs",
        "test_environment", "test_examples", "test_fp8", "test_hf", "test_hf_models", "test_inference", "test_launch",
        "test_library", "test_padding", "test_phased", "test_pipeline", "test_profile", "test_route_chunks",
        "test_router", "test_runtime", "test_runtime_api", "test_sched_ops", "test_tolerance", "test_torch_module",
        "test_tune",
    ),
    # one OS process per rank, the acceptance's subprocesses, the suite under other CPU kernels or Triton
    "multiprocess": (
        "test_acceptance", "test_balance_runtime", "test_checkpoint", "test_cpu_kernels", "test_distributed",
        "test_multiprocess", "test_newest_triton", "test_soak", "test_train_example",
    ),
    # every kernel compiled for sm_90 (ptxas, NVSHMEM's bitcode), no GPU needed
    "sm90": ("test_compile_sm90", "test_gemm_loops", "test_launch_keys_sm90", "test_loop_carries", "test_nvshmem"),
}  # fmt: skip

TIER_OF = {name: tier for tier, names in TIERS.items() for name in names}
