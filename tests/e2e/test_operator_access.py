"""Who may use the operator endpoints (switch apps, cancel queue tickets, change the wait
estimate, delete voices): with API keys, a key marked admin from any address; without keys,
clients on loopback only (the 403 says why). An edge that listens beyond loopback without
keys warns once at start, `omnifabric serve` too (however many edge processes it runs).

The non-loopback client is this machine itself, through its own non-loopback interface
address (an edge bound to 0.0.0.0 sees that address as the peer); skipped where the machine
has none."""

from __future__ import annotations

import http.client
import json
import logging
import socket

import pytest

from omnifabric.edge import access
from omnifabric.edge.config import EdgeConfig, hash_key
from tests.conftest import scaled
from tests.stack import Stack, start_serve, stop_serve

#: What the 403 says to a remote client of an edge without keys.
LOOPBACK_ONLY = "with no API keys configured, operator endpoints answer only clients on loopback"
#: What the start warning says.
WARNING = "operator endpoints answer loopback clients only"
USER, ADMIN = "sk-user", "sk-admin"

#: (method, path, body) of every operator endpoint.
OPERATOR_CALLS = [
    ("PUT", "/api/admin/apps/omni", {"enabled": False}),
    ("GET", "/api/admin/apps", None),
    ("PUT", "/api/config/eta", {"eta_chat_s": 7}),
    ("DELETE", "/api/queue/no-such-ticket", None),
    ("DELETE", "/api/assets/ref_audio/no-such-voice", None),
]


def lan_address() -> str | None:
    """A non-loopback IPv4 address of this machine that a local client can connect to, or
    None."""
    candidates: list[str] = []
    for target in ("10.255.255.255", "192.0.2.255", "203.0.113.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((target, 9))  # UDP: picks a route, sends nothing
            except OSError:
                continue
            candidates.append(probe.getsockname()[0])
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for address in candidates:
        if address.startswith("127.") or address == "0.0.0.0":
            continue
        with socket.socket() as server:
            try:
                server.bind(("0.0.0.0", 0))
                server.listen(1)
                with socket.create_connection((address, server.getsockname()[1]), timeout=2):
                    return address
            except OSError:
                continue
    return None


def call(
    host: str,
    port: int,
    method: str,
    path: str,
    body: object = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict]:
    """One HTTP request straight to host:port (no proxy from the environment)."""
    sent = dict(headers or {})
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        sent["Content-Type"] = "application/json"
    if key:
        sent["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=scaled(10))
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def edge_port(stack: Stack) -> int:
    return int(stack.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


@pytest.fixture
def lan():
    address = lan_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address a local client can reach")
    return address


# ---- the rule, with explicit peer addresses ----------------------------------------------


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "::ffff:127.1.2.3"]
)
def test_loopback_addresses(address):
    assert access.is_loopback(address)


@pytest.mark.parametrize(
    "address",
    ["192.0.2.2", "10.0.0.1", "0.0.0.0", "::", "::ffff:10.0.0.1", "fe80::1%eth0", "fd00::2"]
    + ["128.0.0.1", "localhost", "", None, "not an address"],
)
def test_other_addresses_are_not_loopback(address):
    assert not access.is_loopback(address)


def test_the_operator_rule_with_explicit_peers():
    open_edge = EdgeConfig()
    assert access.operator_refusal(open_edge, "", "127.0.0.1") is None
    assert access.operator_refusal(open_edge, "", "::1") is None
    for peer in ("192.0.2.2", "::ffff:10.1.2.3", ""):
        why = access.operator_refusal(open_edge, "", peer)
        assert why is not None and LOOPBACK_ONLY in why and "admin key" in why

    keyed = EdgeConfig(
        api_key_digests=frozenset({hash_key(USER), hash_key(ADMIN)}),
        admin_key_digests=frozenset({hash_key(ADMIN)}),
    )
    for peer in ("127.0.0.1", "192.0.2.2"):
        assert access.operator_refusal(keyed, f"Bearer {ADMIN}", peer) is None
        for authorization in (f"Bearer {USER}", "", "Bearer nope"):
            assert access.operator_refusal(keyed, authorization, peer) == "this needs an admin key"


def test_the_start_warning_names_open_non_loopback_binds(caplog):
    keyed = {"api_key_digests": frozenset({hash_key(USER)})}
    cases = [
        ({"host": "0.0.0.0"}, True),
        ({"host": "::"}, True),
        ({"host": ""}, True),
        ({"host": "192.0.2.2"}, True),
        ({"host": "127.0.0.1"}, False),
        ({"host": "::1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "0.0.0.0", **keyed}, False),
    ]
    for fields, warns in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="omnifabric.edge.access"):
            assert access.warn_if_open(EdgeConfig(**fields)) is warns, fields
        assert [WARNING in r.getMessage() for r in caplog.records] == ([True] if warns else [])


# ---- a real edge ----------------------------------------------------------------------


def test_without_keys_operator_endpoints_answer_loopback_only(stack, tmp_path, lan):
    stack.start_scheduler()
    stack.start_edge("--host", "0.0.0.0", "--voices-dir", str(tmp_path / "voices"))
    port = edge_port(stack)

    for method, path, body in OPERATOR_CALLS:
        for headers in ({}, {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}):
            status, answer = call(lan, port, method, path, body, headers=headers)
            assert status == 403, (method, path, answer)
            assert answer["success"] is False and answer["error"] == "forbidden"
            assert LOOPBACK_ONLY in answer["message"] and answer["detail"] == answer["message"]
    # Nothing changed, and what users read stays open to them.
    status, answer = call(lan, port, "GET", "/api/apps")
    assert status == 200 and "omni" in [a["app_id"] for a in answer["apps"]]
    status, answer = call(lan, port, "GET", "/api/config/eta")
    assert status == 200 and answer["config"]["eta_chat_s"] != 7
    assert call(lan, port, "GET", "/api/queue")[0] == 200
    assert call(lan, port, "GET", "/api/assets/ref_audio")[0] == 200

    # Loopback operates without a key, as before.
    expected = {
        "/api/admin/apps/omni": 200,
        "/api/admin/apps": 200,
        "/api/config/eta": 200,
        "/api/queue/no-such-ticket": 200,
        "/api/assets/ref_audio/no-such-voice": 404,  # answered: there is no such voice
    }
    for method, path, body in OPERATOR_CALLS:
        status, answer = call("127.0.0.1", port, method, path, body)
        assert status == expected[path], (method, path, answer)
    status, answer = call(lan, port, "GET", "/api/config/eta")
    assert answer["config"]["eta_chat_s"] == 7
    status, answer = call(lan, port, "GET", "/api/apps")
    assert "omni" not in [a["app_id"] for a in answer["apps"]]


def test_with_keys_an_admin_key_operates_from_any_address(stack, tmp_path, lan):
    keys = tmp_path / "keys"
    keys.write_text(f"{USER}\n{ADMIN} admin\n")
    stack.start_scheduler()
    stack.start_edge(
        "--host", "0.0.0.0", "--voices-dir", str(tmp_path / "voices"), "--api-keys-file", str(keys)
    )
    port = edge_port(stack)

    for host in ("127.0.0.1", lan):
        for method, path, body in OPERATOR_CALLS:
            status, answer = call(host, port, method, path, body, key=USER)
            assert status == 403, (host, method, path, answer)
            assert answer["error"] == "forbidden" and answer["message"] == "this needs an admin key"
    status, answer = call(lan, port, "PUT", "/api/admin/apps/omni", {"enabled": False}, ADMIN)
    assert status == 200 and answer["app"]["enabled"] is False
    assert call(lan, port, "GET", "/api/admin/apps", key=ADMIN)[0] == 200
    assert call(lan, port, "PUT", "/api/config/eta", {"eta_chat_s": 7}, ADMIN)[0] == 200
    status, answer = call(lan, port, "DELETE", "/api/queue/no-such-ticket", key=ADMIN)
    assert status == 200 and answer == {"success": False}
    status, answer = call(lan, port, "DELETE", "/api/assets/ref_audio/no-such-voice", key=ADMIN)
    assert status == 404 and "no-such-voice" in answer["message"]


# ---- the start warning ----------------------------------------------------------------


def test_an_open_edge_beyond_loopback_warns_once(stack, tmp_path):
    stack.start_scheduler()
    keys = tmp_path / "keys"
    keys.write_text(f"{USER}\n")
    open_edge = stack.start_edge("--host", "0.0.0.0", "--processes", "2", name="open")
    local_edge = stack.start_edge(name="local")
    keyed_edge = stack.start_edge("--host", "0.0.0.0", "--api-keys-file", str(keys), name="keyed")
    # Each edge wrote its warning (if any) before its ready line.
    assert open_edge.log().count(WARNING) == 1, open_edge.log()
    assert local_edge.log().count(WARNING) == 0, local_edge.log()
    assert keyed_edge.log().count(WARNING) == 0, keyed_edge.log()


def test_serve_beyond_loopback_without_keys_warns_once():
    serve = start_serve(
        "--engine", "synthetic", "--host", "0.0.0.0", "--edge-processes", "2", "--grace", "2"
    )
    seen: list[str] = []
    try:
        assert serve.stdout is not None
        for line in serve.stdout:
            seen.append(line)
            if line.startswith("omnifabric ready: "):
                break
        assert seen and seen[-1].startswith("omnifabric ready: "), "".join(seen)
    finally:
        rest = stop_serve(serve, scaled(60))
    output = "".join(seen) + rest
    assert output.count(WARNING) == 1, output
