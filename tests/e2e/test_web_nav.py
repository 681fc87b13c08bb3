"""Every page of the web client, fetched over HTTP from a real edge, carries the same
navigation (issue 36): a link to every other page, the voice call page included, and its
own entry marked instead of linked; the session viewer links every page."""

from __future__ import annotations

import http.client
from html.parser import HTMLParser

import pytest

from tests.conftest import scaled
from tests.stack import Stack

#: The pages and their entries in the navigation, in its order.
NAV = {
    "/": "omnifabric",
    "/audio": "audio",
    "/half_duplex": "voice call",
    "/video": "video",
    "/chat": "chat",
    "/admin": "admin",
}


class NavParser(HTMLParser):
    """What the page's <nav> elements hold: each as a list of ("a", href) and
    ("current", text) entries."""

    def __init__(self) -> None:
        super().__init__()
        self.navs: list[list[tuple[str, str]]] = []
        self._in_nav = False
        self._in_current = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "nav":
            self._in_nav = True
            self.navs.append([])
        elif self._in_nav and tag == "a":
            self.navs[-1].append(("a", values.get("href") or ""))
        elif self._in_nav and tag == "strong":
            self._in_current = True
            self.navs[-1].append(("current", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav":
            self._in_nav = False
        elif tag == "strong":
            self._in_current = False

    def handle_data(self, data: str) -> None:
        if self._in_current:
            kind, text = self.navs[-1][-1]
            self.navs[-1][-1] = (kind, text + data)


@pytest.fixture(scope="module")
def edge_address(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("web-nav"))
    try:
        stack.start_scheduler()
        stack.start_edge()
        host, port = stack.url.split("//")[1].split("/")[0].rsplit(":", 1)
        yield host, int(port)
    finally:
        stack.stop()


def get(address: tuple[str, int], path: str) -> str:
    conn = http.client.HTTPConnection(*address, timeout=scaled(10))
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200, (path, response.status)
        assert (response.getheader("Content-Type") or "").startswith("text/html")
        return response.read().decode()
    finally:
        conn.close()


def nav_of(address: tuple[str, int], path: str) -> list[tuple[str, str]]:
    parser = NavParser()
    parser.feed(get(address, path))
    assert len(parser.navs) == 1, f"{path}: {len(parser.navs)} <nav> elements"
    return parser.navs[0]


@pytest.mark.parametrize("path", list(NAV))
def test_every_page_links_every_other_page_and_marks_itself(edge_address, path):
    entries = nav_of(edge_address, path)
    expected = [("current", NAV[p]) if p == path else ("a", p) for p in NAV]
    assert entries == expected


def test_the_session_viewer_links_every_page(edge_address):
    entries = nav_of(edge_address, "/s/rt_123_abcdef")
    assert entries == [("a", p) for p in NAV]
