"""The apps (session kinds the pages offer) and whether each takes new sessions:
`GET /api/apps`, `GET /api/admin/apps`, `PUT /api/admin/apps/{id}`, as the reference server
offers them. A disabled app refuses new sessions on every endpoint of its mode (WebSocket:
error `app_disabled` and close 1008; POST /api/chat: 403; gRPC: PERMISSION_DENIED); sessions
already open go on. The switches are the fabric's: a change goes to the scheduler
(SetApp) and every edge process reads them from it about once a second (`follow`), so a
switch reaches every edge of the fabric within that; an edge that cannot reach the
scheduler keeps what it last read. A scheduler that starts afresh (a restart, or a standby
that took over) knows no switches: the edges give it back the ones they had (`follow`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import grpc

from omnifabric.edge import scheduler_client
from omnifabric.edge.scheduler_client import Switches

log = logging.getLogger("omnifabric.edge.apps")

#: How often an edge reads the fabric's app switches from the scheduler, s.
FOLLOW_INTERVAL_S = 1.0


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
    # Its page; clients of the protocol connect to /ws/half_duplex/{id}.
    App("half_duplex_audio", "Half-duplex voice call", "/half_duplex", "half_duplex"),
)


class Apps:
    def __init__(self, apps: tuple[App, ...] = DEFAULT_APPS) -> None:
        self._lock = threading.Lock()
        self._apps = {app.app_id: app for app in apps}
        self._generation = -1
        """The scheduler's generation of the switches applied last (-1: none yet)."""
        self._epoch = ""
        """The scheduler process that generation counts in."""

    def known(self, app_id: str) -> bool:
        return app_id in self._apps

    def apply(self, disabled: Iterable[str], generation: int, epoch: str = "") -> None:
        """Take the fabric's switches (the ids off), unless newer ones of the same
        scheduler process were applied (another epoch: a restarted scheduler, taken)."""
        off = set(disabled)
        with self._lock:
            if epoch == self._epoch and generation < self._generation:
                return
            self._generation, self._epoch = generation, epoch
            for app_id, app in self._apps.items():
                self._apps[app_id] = replace(app, enabled=app_id not in off)

    def lost(self, switches: Switches) -> list[str]:
        """The apps off here that `switches` would turn on only because they come from a
        scheduler process that started afresh (another epoch, never switched: generation
        0, nothing off), for `follow` to switch off there again; [] otherwise."""
        with self._lock:
            fresh = switches.epoch != self._epoch and not switches.generation
            if not self._epoch or not fresh or switches.disabled:
                return []
            return sorted(app_id for app_id, app in self._apps.items() if not app.enabled)

    def take(self, switches: Switches) -> None:
        """Apply the scheduler's switches (GetApps and SetApp answer them alike)."""
        self.apply(switches.disabled, switches.generation, switches.epoch)

    def view(self, app_id: str) -> dict[str, Any] | None:
        """One app's admin view, or None for an unknown id."""
        with self._lock:
            app = self._apps.get(app_id)
        return None if app is None else _admin_view(app)

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

    async def switch(self, stub: Any, app_id: str, enabled: bool) -> dict[str, Any] | None:
        """Switch an app for the whole fabric (the scheduler's SetApp; its AioRpcError
        when it cannot be reached) and here at once; its admin view, or None for an id not
        in the catalog."""
        if not self.known(app_id):
            return None
        self.take(await scheduler_client.set_app(stub, app_id, enabled, timeout_s=5.0))
        return self.view(app_id)


async def follow(apps: Apps, stub: Any, interval_s: float = FOLLOW_INTERVAL_S) -> None:
    """Keep `apps` as the scheduler says, reading GetApps every `interval_s` until
    cancelled; while the scheduler does not answer the last switches stay (logged once).
    A scheduler that started afresh is given back the apps that were off (SetApp)."""
    failing = False
    while True:
        try:
            switches = await scheduler_client.get_apps(stub, timeout_s=2 * interval_s)
            if lost := apps.lost(switches):
                log.info("app switches: a new scheduler; switching %s off again", ",".join(lost))
                for app_id in lost:
                    switches = await scheduler_client.set_app(
                        stub, app_id, False, timeout_s=2 * interval_s
                    )
        except grpc.aio.AioRpcError as err:
            if not failing:
                log.warning("app switches: the scheduler did not answer (%s)", err.code().name)
            failing = True
        else:
            if failing:
                log.info("app switches: read from the scheduler again")
            failing = False
            apps.take(switches)
        await asyncio.sleep(interval_s)


def _admin_view(app: App) -> dict[str, Any]:
    view = asdict(app)
    view.pop("mode")
    return view
