"""The `omnifabric` command: serve, scheduler, worker, edge, probe, bench, eval, eval-tools,
soak, stubs."""

from __future__ import annotations

import sys

from omnifabric.common import grpc_io

USAGE = """usage: omnifabric COMMAND [args]

commands:
  serve       the whole stack on this machine (scheduler, workers, edge)
  scheduler   one scheduler service (multi-host)
  worker      one worker service: one engine on one device (multi-host)
  edge        one edge: public WebSocket + RealtimeService gRPC (multi-host)
  probe       stream a WAV file to an endpoint and save the reply
  replay      replay a recorded session (edge --record-dir) and compare the answers
  smoke       check every public surface of a running edge (all modes, legacy endpoints)
  bench       fabric overhead per unit vs a websockets echo and direct gRPC, same run
  eval        ask a stack spoken questions (several voices) and score the spoken answers
  eval-tools  ask a stack requests that need a function and ones that need none; score calls
  soak        the long-run reliability rows (L1 L2 L3 F1 FUZZ) on their own local stack
  fleet-bench the scheduler alone under simulated workers and callers, level by level
  stubs       regenerate the gRPC stubs from proto/ (--check: fail when stale)
  config-doc  write docs/configuration.md's tables from the settings (--check: fail when stale)

`omnifabric COMMAND --help` describes each command's options."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    grpc_io.choose()  # before a command's imports load grpc
    if command == "serve":
        from omnifabric.tools.serve import main as run
    elif command == "scheduler":
        from omnifabric.scheduler.main import main as run
    elif command == "worker":
        from omnifabric.worker.main import main as run
    elif command == "edge":
        from omnifabric.edge.main import main as run
    elif command == "probe":
        from omnifabric.tools.probe import main as run
    elif command == "replay":
        from omnifabric.tools.replay import main as run
    elif command == "smoke":
        from omnifabric.tools.smoke import main as run
    elif command == "bench":
        from omnifabric.tools.perf.bench import main as run
    elif command == "eval":
        from omnifabric.tools.eval_reference import main as run
    elif command == "eval-tools":
        from omnifabric.tools.eval_tools import main as run
    elif command == "soak":
        from omnifabric.tools.perf.soak import main as run
    elif command == "fleet-bench":
        from omnifabric.tools.fleet_bench import main as run
    elif command == "stubs":
        from omnifabric.tools.gen_stubs import main as run
    elif command == "config-doc":
        from omnifabric.tools.config_doc import main as run
    else:
        print(f"omnifabric: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
