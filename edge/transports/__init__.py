"""How bytes reach the connection drivers: WebSocket (websocket.py), HTTP/1.1 on the same
port (http.py) and gRPC (grpc.py). Each one owns its socket or call, bounds what waits to
be sent, and knows nothing of the protocol's messages beyond their encoding."""
