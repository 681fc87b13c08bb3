"""Recorded sessions over HTTP (the edge's `--record-dir`, edge/recording.py), as the
reference server offers them: `GET /api/sessions`, `GET /api/sessions/{sid}` (meta and the
per-unit timeline), `GET /api/sessions/{sid}/recording` (the reference's recording.json
timeline and ours), `GET
/api/sessions/{sid}/assets/{path}` (a file of the recording: its audio, its units' inputs),
`GET /api/sessions/{sid}/download` (the folder as a zip). The viewer page `/s/{sid}` reads
them. Session ids and asset paths are checked: nothing outside the recording folder is ever
read."""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from omnifabric.edge.recording import RECORDING_ID

PREFIX = "/api/sessions"
#: What an asset is served as, by suffix; other files are not served.
ASSET_TYPES = {
    ".wav": "audio/wav",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".json": "application/json",
    ".jsonl": "application/x-ndjson",
}


@dataclass(frozen=True)
class Answer:
    """An answer: JSON (`body` a dict) or bytes with their content type."""

    status: HTTPStatus
    body: Any
    content_type: str = "application/json"
    filename: str | None = None
    """Set for a download: sent as Content-Disposition: attachment."""


def _error(status: HTTPStatus, code: str, message: str) -> Answer:
    return Answer(status, {"success": False, "error": code, "message": message, "detail": message})


class Recordings:
    """The recordings under one folder, read on request."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None

    def answer(self, path: str) -> Answer:
        """The answer to a GET under /api/sessions."""
        if self.root is None:
            return _error(
                HTTPStatus.NOT_FOUND, "not_found", "this edge records no sessions (--record-dir)"
            )
        rest = path.removeprefix(PREFIX).strip("/")
        if not rest:
            return Answer(HTTPStatus.OK, self.listing())
        sid, _, tail = rest.partition("/")
        if not RECORDING_ID.fullmatch(sid):
            return _error(HTTPStatus.BAD_REQUEST, "invalid_request", "not a session id")
        folder = self.root / sid
        if not (folder / "meta.json").is_file():
            return _error(HTTPStatus.NOT_FOUND, "not_found", f"no recorded session {sid}")
        if tail == "":
            meta = _json(folder / "meta.json")
            return Answer(HTTPStatus.OK, {**meta, "timeline": _units(folder)})
        if tail == "recording":
            # The reference server's recording.json (chunks) where the recording has one
            # (it is written when the session ends), and our per-unit lines.
            timeline = folder / "recording.json"
            body = _json(timeline) if timeline.is_file() else {"session_id": sid}
            return Answer(HTTPStatus.OK, {**body, "units": _units(folder)})
        if tail == "download":
            return Answer(HTTPStatus.OK, _zip(folder), "application/zip", f"{sid}.zip")
        if tail.startswith("assets/"):
            return self._asset(folder, tail.removeprefix("assets/"))
        return _error(HTTPStatus.NOT_FOUND, "not_found", f"no such endpoint: {path}")

    def listing(self) -> dict[str, Any]:
        """Every recorded session, newest first: id, mode, times, units, size."""
        assert self.root is not None
        sessions = []
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if folder.is_symlink() or not (folder / "meta.json").is_file():
                    continue
                try:
                    meta = _json(folder / "meta.json")
                except (OSError, ValueError):
                    continue
                started, ended = meta.get("started_unix"), meta.get("ended_unix")
                sessions.append(
                    {
                        "session_id": folder.name,
                        "mode": meta.get("mode"),
                        "path": meta.get("path"),
                        "started_at": meta.get("started_at"),
                        "ended_at": meta.get("ended_at"),
                        "close_reason": meta.get("close_reason"),
                        "units": meta.get("units", 0),
                        "duration_s": round(ended - started, 1) if started and ended else None,
                        "size_bytes": sum(
                            p.stat().st_size for p in folder.rglob("*") if p.is_file()
                        ),
                        "_started": started or 0,
                    }
                )
        sessions.sort(key=lambda s: s.pop("_started"), reverse=True)
        return {"total": len(sessions), "sessions": sessions}

    def _asset(self, folder: Path, relative: str) -> Answer:
        parts = relative.split("/")
        if not relative or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return _error(HTTPStatus.BAD_REQUEST, "invalid_request", "not an asset path")
        path = (folder / relative).resolve()
        if not path.is_relative_to(folder.resolve()):
            return _error(HTTPStatus.BAD_REQUEST, "invalid_request", "not an asset path")
        content_type = ASSET_TYPES.get(path.suffix.lower())
        if content_type is None or not path.is_file():
            return _error(HTTPStatus.NOT_FOUND, "not_found", f"no asset {relative}")
        return Answer(HTTPStatus.OK, path.read_bytes(), content_type)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _units(folder: Path) -> list[dict[str, Any]]:
    """The recording's units.jsonl (a line cut by a crash is skipped)."""
    units = []
    path = folder / "units.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                units.append(json.loads(line))
            except ValueError:
                continue
    return units


def _zip(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                archive.write(path, f"{folder.name}/{path.relative_to(folder).as_posix()}")
    return buffer.getvalue()
