"""The web client's routes (edge.static): pages and /static files with their types, no
path traversal, 404 for the rest, ETag revalidation; through EdgeApp.process_request."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from omnifabric.edge import static
from omnifabric.edge.app import EdgeApp
from omnifabric.edge.config import EdgeConfig, hash_key
from omnifabric.edge.metrics import EdgeMetrics


def request(path: str, **headers: str) -> Request:
    return Request(path, Headers(headers))


@pytest.fixture
def root(tmp_path):
    web = tmp_path / "web"
    (web / "js").mkdir(parents=True)
    (web / "css").mkdir()
    for page in static.PAGES.values():
        (web / page).write_text(f"<!doctype html><title>{page}</title>")
    (web / "js" / "app.js").write_text("export const x = 1;\n")
    (web / "css" / "app.css").write_text("body { margin: 0 }\n")
    (web / "notes.py").write_text("SECRET-CONTENT = 1\n")
    (web / ".hidden.js").write_text("hidden\n")
    (tmp_path / "outside.js").write_text("OUTSIDE-CONTENT\n")
    os.symlink(tmp_path / "outside.js", web / "js" / "link.js")
    return web


@pytest.mark.parametrize(
    "path, body, content_type",
    [
        ("/", b"index.html", "text/html; charset=utf-8"),
        ("/audio", b"audio.html", "text/html; charset=utf-8"),
        ("/video", b"video.html", "text/html; charset=utf-8"),
        ("/chat", b"chat.html", "text/html; charset=utf-8"),
        ("/admin", b"admin.html", "text/html; charset=utf-8"),
        ("/static/js/app.js", b"export const", "text/javascript; charset=utf-8"),
        ("/static/css/app.css", b"margin", "text/css; charset=utf-8"),
        ("/static/chat.html", b"chat.html", "text/html; charset=utf-8"),
    ],
)
def test_pages_and_files_with_their_types(root, path, body, content_type):
    response = static.static_response(request(path), path, root)
    assert response.status_code == 200
    assert body in response.body
    assert response.headers["Content-Type"] == content_type
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["Content-Length"] == str(len(response.body))
    assert response.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    "path",
    [
        "/static/../static.py",
        "/static/js/../../outside.js",
        "/static/%2e%2e/outside.js",
        "/static/js/%2E%2E/%2E%2E/outside.js",
        "/static/..%2foutside.js",
        "/static/js/link.js",  # a symlink out of the web root
        "/static//etc/passwd",
        "/static/%2Fetc%2Fpasswd",
        "/static/js\\..\\..\\outside.js",
        "/static/js/app.js%00.css",
        "/static/notes.py",  # not a type the client serves
        "/static/.hidden.js",
        "/static/",
        "/static/js",
        "/static/missing.js",
        "/index.html",
        "/audio/",
    ],
)
def test_traversal_and_unknown_paths_are_404(root, path):
    response = static.static_response(request(path), path, root)
    assert response.status_code == 404
    assert b"CONTENT" not in response.body


def test_etag_revalidation_answers_304_until_the_file_changes(root):
    first = static.static_response(request("/static/js/app.js"), "/static/js/app.js", root)
    etag = first.headers["ETag"]
    again = static.static_response(
        request("/static/js/app.js", **{"If-None-Match": etag}), "/static/js/app.js", root
    )
    assert again.status_code == 304 and again.body == b""
    assert "Content-Length" not in again.headers
    (root / "js" / "app.js").write_text("export const x = 22;\n")
    changed = static.static_response(
        request("/static/js/app.js", **{"If-None-Match": etag}), "/static/js/app.js", root
    )
    assert changed.status_code == 200 and b"22" in changed.body


async def test_process_request_serves_pages_without_a_key_but_not_status():
    """With API keys on, pages and files load without a key (they hold no data); /status
    and the WebSocket endpoints still need one."""
    config = EdgeConfig(api_key_digests=frozenset({hash_key("sk-static")}))
    app = EdgeApp(config, None, EdgeMetrics())  # type: ignore[arg-type]

    async def status_of(path: str) -> int:
        conn = SimpleNamespace(remote_address=("127.0.0.1", 50000))  # what the API reads
        response = await app.process_request(conn, request(path))  # type: ignore[arg-type]
        assert response is not None
        return response.status_code

    assert await status_of("/admin?x=1") == 200
    assert await status_of("/static/js/admin.js") == 200
    assert await status_of("/nowhere") == 404
    assert await status_of("/status") == 401
    assert await status_of("/v1/realtime?mode=audio") == 401


def test_pages_get_their_navigation_from_the_edge(root):
    """Each page's empty <nav id="site-nav"> is filled from static.SITE: every page linked,
    the page itself marked; the same file under /static/ is served as it is."""
    (root / "audio.html").write_text(f"<header>{static.NAV_PLACEHOLDER.decode()}</header>")
    body = static.static_response(request("/audio"), "/audio", root).body
    assert b'<strong aria-current="page">audio</strong>' in body
    for page in static.SITE:
        if page.path != "/audio":
            assert f'<a href="{page.path}">{page.label}</a>'.encode() in body
    assert b'href="/audio"' not in body
    raw = static.static_response(request("/static/audio.html"), "/static/audio.html", root)
    assert static.NAV_PLACEHOLDER in raw.body


def test_every_page_file_leaves_its_navigation_to_the_edge():
    """No page of edge/web/ writes a navigation of its own: each holds the placeholder."""
    for name in [*static.PAGES.values(), "viewer.html"]:
        html = (static.WEB_ROOT / name).read_bytes()
        assert html.count(b"<nav") == 1 and static.NAV_PLACEHOLDER in html, name
