"""The load generator: `slmrank bench --target HOST:PORT` (command.py) and the benchmarks'
client (ops/bench/bench_grpc.py drives its servers with loop.sweep). A layer above
service.serving, whose generated stubs and client it uses, and below service.cli.

  workloads.py    W1..W8 (W7, W8: beams in a catalog), the variable-shape mixes, request files; their messages and FLOPs
  catalogs.py     the workloads' seeded random semantic-ID catalogs (catalog files, written with numpy)
  loop.py         closed loop at levels, open loop at Poisson rates; the capacity at the SLO
  server_view.py  the server's /metrics over a measured window
  report.py       the table, bench.json, bench.csv, the PNG charts (png.py draws them)
  traffic.py      `slmrank traffic LOG`: the request distribution of a server's JSON access log
"""
