"""`omnifabric bench` and `omnifabric soak`, one room per concern.

The commands:
- bench: flags, the run's plan (warm-up, levels, max search) and its output files;
- soak: flags, the rows in order, the table and the JSON file.

bench's rooms:
- units: the units every path sends, and their pacing;
- ledger: per-unit figures (Samples, UnitLedger) and what a level measured (Level);
- fabric: the paths through the edge (fabric: the public WebSocket protocol;
  grpc-realtime: the edge's RealtimeService);
- baselines: the ws-echo, grpc-echo, grpc-thread, grpc-sync and grpc-direct paths;
- bench_stack: the processes a bench run starts and stops;
- levels: running one level of one path (progress, processes, steal retries, py-spy);
- report: the JSON document, the markdown tables and the plot.

soak's rooms:
- soak_row: a row's result, its stack, the services' figures and progress lines;
- soak_rows: the long rows L1, L2, L3 and FUZZ;
- soak_f1: the F1 row (workers killed under sessions).

Shared by both (the tests import stack, wsclient and metrics from here too):
- console: the event loop and progress lines;
- procs: CPU and memory of processes from /proc;
- metrics: a service's /metrics page;
- stack: real service processes on free ports (Stack, `omnifabric serve`);
- wsclient: a thin WebSocket client awaiting typed events.
"""
