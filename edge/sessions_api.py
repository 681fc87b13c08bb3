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
import mmap
import os
import re
import zipfile
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, BinaryIO

from omnifabric.edge.recording import RECORDING_ID

PREFIX = "/api/sessions"
#: POST /api/sessions/{sid}/upload-recording: the page's own recording of the session.
UPLOAD = "upload-recording"
#: The largest uploaded file, bytes (the reference server's limit), and the multipart
#: framing allowed around it.
UPLOAD_MAX_BYTES = 200 * 1024 * 1024
UPLOAD_FRAMING_BYTES = 64 * 1024
#: What may be uploaded, by content type -> the stored file's suffix.
UPLOAD_TYPES = {
    "video/webm": ".webm",
    "video/mp4": ".mp4",
    "audio/wav": ".wav",
    "audio/webm": ".webm",
}
_COPY_BYTES = 1 << 20
#: What an asset is served as, by suffix; other files are not served.
ASSET_TYPES = {
    ".wav": "audio/wav",
    ".webm": "video/webm",
    ".mp4": "video/mp4",
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

    def upload_target(self, path: str) -> str | None:
        """The session id a POST .../{sid}/upload-recording names, else None."""
        rest = path.removeprefix(PREFIX + "/")
        sid, _, tail = rest.partition("/")
        return sid if path.startswith(PREFIX + "/") and tail == UPLOAD else None

    def upload(self, sid: str, content_type: str, body: BinaryIO) -> Answer:
        """Store the file part of a multipart/form-data body (field `file`) as the
        session's `frontend_replay.<ext>`, as the reference server does."""
        if self.root is None:
            return _error(
                HTTPStatus.NOT_FOUND, "not_found", "this edge records no sessions (--record-dir)"
            )
        if not RECORDING_ID.fullmatch(sid):
            return _error(HTTPStatus.BAD_REQUEST, "invalid_request", "not a session id")
        folder = self.root / sid
        if not (folder / "meta.json").is_file():
            return _error(HTTPStatus.NOT_FOUND, "not_found", f"Session not found: {sid}")
        try:
            part_type, start, end = file_part(content_type, body)
        except ValueError as exc:
            return _error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
        suffix = UPLOAD_TYPES.get(part_type)
        if suffix is None:
            allowed = ", ".join(UPLOAD_TYPES)
            return _error(
                HTTPStatus.BAD_REQUEST,
                "invalid_request",
                f"Unsupported file type: {part_type or 'none'} (send {allowed})",
            )
        size = end - start
        if size > UPLOAD_MAX_BYTES:
            return _error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "too_large", "File too large (max 200MB)"
            )
        name = f"frontend_replay{suffix}"
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            body.seek(start)
            left = size
            while left:
                chunk = body.read(min(left, _COPY_BYTES))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
        os.replace(tmp, folder / name)
        return Answer(HTTPStatus.OK, {"status": "ok", "path": name, "size_bytes": size})

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


_BOUNDARY = re.compile(r'boundary="?([^";]{1,70})"?', re.IGNORECASE)
_FIELD = re.compile(r'\bname="([^"]*)"', re.IGNORECASE)


def file_part(content_type: str, body: BinaryIO) -> tuple[str, int, int]:
    """(its content type, start, end) of the part named `file` in a multipart/form-data
    body held in a real file (searched through mmap: never read into memory whole);
    ValueError naming what is wrong."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError("send multipart/form-data with the file in a field named 'file'")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise ValueError("multipart/form-data without a boundary")
    delimiter = b"--" + match.group(1).encode("latin-1")
    body.seek(0, os.SEEK_END)
    if body.tell() == 0:
        raise ValueError("the body is empty")
    with mmap.mmap(body.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos = data.find(delimiter)
        while pos >= 0:
            start = pos + len(delimiter)
            if data[start : start + 2] == b"--":
                break  # the closing delimiter
            head_end = data.find(b"\r\n\r\n", start, start + 16 * 1024)
            if head_end < 0:
                raise ValueError("a multipart part without headers")
            head = data[start:head_end].decode("latin-1")
            end = data.find(b"\r\n" + delimiter, head_end + 4)
            if end < 0:
                raise ValueError("a multipart part without its closing boundary")
            headers = {}
            for line in head.split("\r\n"):
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
            field = _FIELD.search(headers.get("content-disposition", ""))
            if field is not None and field.group(1) == "file":
                part_type = headers.get("content-type", "").split(";")[0].strip().lower()
                return part_type, head_end + 4, end
            pos = end + 2
    raise ValueError("no field named 'file' in the form")


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
