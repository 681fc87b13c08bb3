"""The browser client's files, served by the edge on its WebSocket port with no build step.

Pages (`/`, `/audio`, `/half_duplex`, `/video`, `/chat`, `/admin`, the viewer `/s/<id>`) and
`/static/<path>` from edge/web/. They hold no data, so they need no API key; what they fetch
or open does. Every page's navigation is written here, from SITE, into the page's empty
`<nav id="site-nav"></nav>` as it is served (a page copied without the edge keeps it empty).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from html import escape
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

WEB_ROOT = Path(__file__).resolve().parent / "web"
STATIC_PREFIX = "/static/"

#: The reference server's page paths -> ours (302); its half-duplex page's path is ours too.
REFERENCE_PAGES = {
    "/turnbased": "/chat",
    "/omni": "/video",
    "/audio_duplex": "/audio",
}


@dataclass(frozen=True)
class Page:
    path: str
    file: str
    """Under edge/web/."""
    label: str
    """Its entry in the navigation."""


#: The pages, in the order of the navigation every page shows: one line per page.
SITE = (
    Page("/", "index.html", "omnifabric"),
    Page("/audio", "audio.html", "audio"),
    Page("/half_duplex", "half_duplex.html", "voice call"),
    Page("/video", "video.html", "video"),
    Page("/chat", "chat.html", "chat"),
    Page("/admin", "admin.html", "admin"),
)
PAGES = {page.path: page.file for page in SITE}

#: What a page holds where its navigation goes; the edge fills it (nav_html).
NAV_PLACEHOLDER = b'<nav id="site-nav"></nav>'

#: What may be served, by suffix; any other file under edge/web/ is a 404.
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".ico": "image/x-icon",
    ".wav": "audio/wav",
    ".txt": "text/plain; charset=utf-8",
}

#: Largest file served; edge/web/ holds small hand-written files only.
MAX_FILE_BYTES = 4 * 1024 * 1024


#: The session viewer: `/s/<session id>` (the page reads the id from its own URL).
VIEWER_PREFIX = "/s/"


def nav_html(current: str | None) -> bytes:
    """The navigation: a link to every page of SITE, the `current` one (a path) in
    `<strong aria-current="page">` instead of a link."""
    entries = [
        f'<strong aria-current="page">{escape(page.label)}</strong>'
        if page.path == current
        else f'<a href="{escape(page.path)}">{escape(page.label)}</a>'
        for page in SITE
    ]
    return f'<nav id="site-nav">{" · ".join(entries)}</nav>'.encode()


#: Part of every page's ETag: a page whose file is unchanged still changes with SITE.
_NAV_TAG = hashlib.sha256(nav_html(None)).hexdigest()[:8]


def with_nav(body: bytes, current: str | None) -> bytes:
    """A page's HTML with its navigation filled in (unchanged without the placeholder)."""
    return body.replace(NAV_PLACEHOLDER, nav_html(current), 1)


def is_static(path: str) -> bool:
    """Whether a request path belongs to the web client (no API key needed)."""
    return path in PAGES or path.startswith((STATIC_PREFIX, VIEWER_PREFIX))


def resolve(path: str, root: Path = WEB_ROOT) -> Path | None:
    """The file a request path names under root, or None: unknown page, traversal
    (`..`, encoded or not), hidden segments, or a type not in CONTENT_TYPES."""
    if path in PAGES:
        relative = PAGES[path]
    elif path.startswith(VIEWER_PREFIX):
        relative = "viewer.html"
    elif path.startswith(STATIC_PREFIX):
        relative = unquote(path[len(STATIC_PREFIX) :])
    else:
        return None
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return None
    if "\\" in relative or "\x00" in relative:
        return None
    candidate = (root / relative).resolve()
    # A symlink inside edge/web/ must not lead out of it either.
    if not candidate.is_relative_to(root.resolve()) or candidate.suffix not in CONTENT_TYPES:
        return None
    return candidate


def _response(status: HTTPStatus, headers: list[tuple[str, str]], body: bytes) -> Response:
    common = [
        # The server closes after each response (websockets' HTTP path): say so.
        ("Connection", "close"),
        ("X-Content-Type-Options", "nosniff"),
    ]
    if status != HTTPStatus.NOT_MODIFIED:  # a 304's length would have to be the 200's
        common.append(("Content-Length", str(len(body))))
    return Response(status.value, status.phrase, Headers([*headers, *common]), body)


def not_found(path: str) -> Response:
    """404 with a short plain-text reason."""
    body = f"no such page or file: {path[:200]}\n".encode()
    return _response(HTTPStatus.NOT_FOUND, [("Content-Type", "text/plain; charset=utf-8")], body)


def static_response(request: Request, path: str, root: Path = WEB_ROOT) -> Response:
    """Answer GET for a page or a static file: 200 with its Content-Type and
    `Cache-Control: no-cache`, 304 when the client's ETag still matches, else 404."""
    target = resolve(path, root)
    try:
        if target is None:
            return not_found(path)
        stat = target.stat()
        if not target.is_file() or stat.st_size > MAX_FILE_BYTES:
            return not_found(path)
        page = path in PAGES or path.startswith(VIEWER_PREFIX)
        version = f"{stat.st_mtime_ns:x}-{stat.st_size:x}"
        etag = f'"{version}-{_NAV_TAG}"' if page else f'"{version}"'
        headers = [
            ("Content-Type", CONTENT_TYPES[target.suffix]),
            # Pages change with the server: revalidate every time (cheap with the ETag).
            ("Cache-Control", "no-cache"),
            ("ETag", etag),
        ]
        if etag in _etags(request.headers.get("If-None-Match", "")):
            return _response(HTTPStatus.NOT_MODIFIED, headers, b"")
        with open(target, "rb") as f:
            body = f.read(MAX_FILE_BYTES + 1)
    except OSError:  # vanished or unreadable between the checks and the read
        return not_found(path)
    if page:
        body = with_nav(body, path)
    return _response(HTTPStatus.OK, headers, body)


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}
