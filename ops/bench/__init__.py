"""The benchmarks. Each runs from the repository root as `python -m ops.bench.<module> ...` (the
GPU machine's scripts in ops/device/ run them so) and is imported as `from ops.bench import
<module>` (the tests: pyproject.toml puts the root on pytest's path).

  bench_executor  the executor alone (no RPC): identity across runtimes, graph vs eager, throughput
  bench_grpc      closed loop over gRPC, beside the Hugging Face peer (hf_peer) on the same weights
  bench_host      slmrank's own host work on the event loop, per request and stage (no GPU)
  bench_kernels   the Triton kernels at the workloads' shapes, against their floors (GPU)
  overload_bench  open loop at a multiple of capacity; quiet callers through h2call (HTTP/2 by hand)
  loop_cost       the event loop's CPU per request: the serial part of the server
"""
