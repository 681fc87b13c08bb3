"""tools/serve.py: what serve hands its workers and its edge."""

from __future__ import annotations

from omnifabric.tools import serve


def test_workers_get_what_was_given_and_nothing_else():
    args = serve.build_parser().parse_args(
        ["--engine", "minicpmo", "--slots", "4", "--context-window", "basic"]
        + ["--window-high-tokens", "3000", "--audio-limit-s", "60", "--text-only"]
        + ["--worker-base-port", "22400", "--grace", "3"]
    )
    argv = serve.worker_args(args, 1, "127.0.0.1:1,127.0.0.1:2", "/v.wav")
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--port"] == "22401" and pairs["--scheduler"] == "127.0.0.1:1,127.0.0.1:2"
    assert pairs["--slots"] == "4" and pairs["--context-window"] == "basic"
    assert pairs["--window-high-tokens"] == "3000" and pairs["--audio-limit-s"] == "60.0"
    assert pairs["--default-voice"] == "/v.wav" and pairs["--grace"] == "3.0"
    assert argv[-1] == "--text-only"
    assert "--window-low-tokens" not in argv and "--model-dir" not in argv


def test_port_zero_stays_zero_and_the_edge_gets_its_flags():
    args = serve.build_parser().parse_args(["--worker-base-port", "0", "--edge-processes", "2"])
    argv = serve.worker_args(args, 3, "h:1", None)
    assert argv[argv.index("--port") + 1] == "0" and "--default-voice" not in argv
    edge = serve.edge_args(args, "h:1", None)
    assert edge[edge.index("--processes") + 1] == "2" and "--record-dir" not in edge


def test_the_web_client_address_is_one_a_browser_here_can_use():
    assert serve.web_client_url("ws://127.0.0.1:8006/v1/realtime") == "http://127.0.0.1:8006/"
    # A wildcard bind: 0.0.0.0 is no secure context, so the microphone would be refused.
    assert serve.web_client_url("ws://0.0.0.0:8006/v1/realtime") == "http://127.0.0.1:8006/"
    assert serve.web_client_url("wss://[::]:8443/v1/realtime") == "https://[::1]:8443/"
    assert serve.web_client_url("ws://[::1]:9000/v1/realtime") == "http://[::1]:9000/"
    assert (
        serve.web_client_url("wss://voice.example:443/v1/realtime") == "https://voice.example:443/"
    )


def test_the_edges_grpc_address_is_one_a_client_here_can_dial():
    # serve printed no gRPC address: clients of the RealtimeService had to find the port.
    ready = "ws://0.0.0.0:8006/v1/realtime grpc={}"
    assert serve.edge_grpc_address(ready.format("0.0.0.0:8007")) == "127.0.0.1:8007"
    assert serve.edge_grpc_address(ready.format("[::]:8007")) == "[::1]:8007"
    assert serve.edge_grpc_address(ready.format("[fd00::2]:8007")) == "[fd00::2]:8007"
    assert serve.edge_grpc_address(ready.format("10.0.0.5:9")) == "10.0.0.5:9"
    assert serve.edge_grpc_address(ready.format("127.0.0.1:-1")) is None
    assert serve.edge_grpc_address("ws://127.0.0.1:8006/v1/realtime") is None
