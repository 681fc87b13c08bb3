"""The apps (session kinds the pages offer) and whether each takes new sessions:
`GET /api/apps`, `GET /api/admin/apps`, `PUT /api/admin/apps/{id}`, as the reference server
offers them. A disabled app refuses new sessions on every endpoint of its mode (WebSocket:
error `app_disabled` and close 1008; POST /api/chat: 403; gRPC: PERMISSION_DENIED); sessions
already open go on. The state lives in this edge's memory: it starts all enabled, and each
edge of a fleet is switched on its own.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class App:
    app_id: str
    name: str
    route: str
    mode: str
    """The session mode it serves (audio, video, chat)."""
    enabled: bool = True


#: The reference server's ids, our pages' routes.
DEFAULT_APPS = (
    App("turnbased", "Turn-based chat", "/chat", "chat"),
    App("omni", "Omni full-duplex (video)", "/video", "video"),
    App("audio_duplex", "Audio full-duplex", "/audio", "audio"),
    # No page of its own: clients connect to /ws/half_duplex/{id}.
    App("half_duplex_audio", "Half-duplex voice call", "/ws/half_duplex", "half_duplex"),
)


class Apps:
    def __init__(self, apps: tuple[App, ...] = DEFAULT_APPS) -> None:
        self._lock = threading.Lock()
        self._apps = {app.app_id: app for app in apps}

    def enabled(self, mode: str) -> bool:
        """Whether new sessions of `mode` are taken (a mode no app names: yes)."""
        with self._lock:
            return all(app.enabled for app in self._apps.values() if app.mode == mode)

    def public(self) -> dict[str, Any]:
        """The enabled apps, for the pages: {apps: [{app_id, name, route}]}."""
        with self._lock:
            apps = [a for a in self._apps.values() if a.enabled]
        return {"apps": [{"app_id": a.app_id, "name": a.name, "route": a.route} for a in apps]}

    def admin(self) -> dict[str, Any]:
        """Every app with its state: {apps: [{app_id, name, route, enabled}]}."""
        with self._lock:
            apps = list(self._apps.values())
        return {"apps": [_admin_view(a) for a in apps]}

    def set_enabled(self, app_id: str, enabled: bool) -> dict[str, Any] | None:
        """Switch an app; its admin view, or None for an unknown id."""
        with self._lock:
            app = self._apps.get(app_id)
            if app is None:
                return None
            self._apps[app_id] = app = replace(app, enabled=enabled)
        return _admin_view(app)


def _admin_view(app: App) -> dict[str, Any]:
    view = asdict(app)
    view.pop("mode")
    return view
