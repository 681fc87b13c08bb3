"""System-prompt presets, per mode, from files an operator edits (the reference server's
`GET /api/presets` and `GET /api/presets/{mode}/{id}/audio`).

Layout: `ROOT/<mode>/<name>.yaml` (or .yml, .json), one preset a file:

    id: english_call            # default: the file name without extension
    order: 1                    # list position within the mode (default 999)
    name: English call          # default: the id
    description: ...
    system_prompt: "..."        # plain text, or system_content for text and audio parts:
    system_content:
      - {type: text, text: "..."}
      - {type: audio, path: voices/sample.wav}
    ref_audio_path: voices/sample.wav   # the reference voice of the preset

Audio paths are relative to ROOT and must stay inside it. The listing carries audio metadata
only (name, duration: read from the WAV header); the audio itself (float32 16 kHz mono in
base64) comes from the audio endpoint, decoded when asked. The files are read again when one
of them changes (a listing checks their modification times), so an edit needs no restart.
A file that cannot be used is skipped and logged, never fatal.
"""

from __future__ import annotations

import base64
import json
import logging
import wave
from pathlib import Path
from typing import Any

from omnifabric.edge.errors import InvalidPayload
from omnifabric.edge.pcm import wav_to_pcm16k

log = logging.getLogger("omnifabric.edge.presets")

#: The presets shipped with omnifabric (used when no directory is configured).
PACKAGED = Path(__file__).resolve().parent / "preset_files"
SUFFIXES = (".yaml", ".yml", ".json")
#: Largest preset file and audio file read, bytes.
MAX_PRESET_BYTES = 256 * 1024
MAX_AUDIO_BYTES = 32 * 1024 * 1024


class Presets:
    """The presets under one directory, listed and served as the reference server does."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else PACKAGED
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._listing: dict[str, list[dict[str, Any]]] = {}

    def listing(self) -> dict[str, list[dict[str, Any]]]:
        """mode -> its presets in order, audio as metadata (`data` null)."""
        signature = self._files_signature()
        if signature != self._signature:
            self._listing = self._load()
            self._signature = signature
            total = sum(len(v) for v in self._listing.values())
            log.info("presets: %d in %d modes from %s", total, len(self._listing), self.root)
        return self._listing

    def audio(self, mode: str, preset_id: str) -> dict[str, Any] | None:
        """The audio of one preset (its system_content audio parts, its reference voice), or
        None when there is no such preset."""
        preset = next((p for p in self.listing().get(mode, ()) if p["id"] == preset_id), None)
        if preset is None:
            return None
        result: dict[str, Any] = {}
        if "system_content" in preset:
            result["system_content_audio"] = [
                self._audio_body(part)
                for part in preset["system_content"]
                if part.get("type") == "audio"
            ]
        if preset.get("ref_audio"):
            result["ref_audio"] = self._audio_body(preset["ref_audio"])
        return result

    # ---- reading -----------------------------------------------------------------------

    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for mode in self.root.iterdir()
            if mode.is_dir()
            for p in mode.iterdir()
            if p.suffix in SUFFIXES and p.is_file()
        )

    def _files_signature(self) -> tuple[tuple[str, int, int], ...]:
        out = []
        for path in self._files():
            try:
                stat = path.stat()
            except OSError:
                continue
            out.append((str(path), stat.st_mtime_ns, stat.st_size))
        return tuple(out)

    def _load(self) -> dict[str, list[dict[str, Any]]]:
        result: dict[str, list[dict[str, Any]]] = {}
        for path in self._files():
            try:
                preset = self._preset(path)
            except (OSError, ValueError) as exc:
                log.warning("preset %s skipped: %s", path, exc)
                continue
            mode = result.setdefault(path.parent.name, [])
            if any(p["id"] == preset["id"] for p in mode):
                log.warning("preset %s skipped: id %r used twice", path, preset["id"])
                continue
            mode.append(preset)
        for presets in result.values():
            presets.sort(key=lambda p: (p["order"], p["id"]))
        return result

    def _preset(self, path: Path) -> dict[str, Any]:
        if path.stat().st_size > MAX_PRESET_BYTES:
            raise ValueError(f"larger than {MAX_PRESET_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else _yaml(text)
        if not isinstance(raw, dict):
            raise ValueError("not a mapping of preset fields")
        preset: dict[str, Any] = {
            "id": _text(raw, "id", path.stem),
            "order": raw.get("order", 999),
            "name": _text(raw, "name", _text(raw, "id", path.stem)),
            "description": _text(raw, "description", ""),
        }
        if not isinstance(preset["order"], int) or isinstance(preset["order"], bool):
            raise ValueError("order must be an integer")
        if "system_prompt" in raw:
            preset["system_prompt"] = _text(raw, "system_prompt", "")
        if "system_content" in raw:
            parts = raw["system_content"]
            if not isinstance(parts, list):
                raise ValueError("system_content must be a list of parts")
            preset["system_content"] = [self._part(part) for part in parts]
        if raw.get("ref_audio_path"):
            preset["ref_audio"] = self._audio_meta(_text(raw, "ref_audio_path", ""))
        for key, value in raw.items():  # anything else an operator added, as it is
            if key not in preset and key not in ("ref_audio_path", "system_content"):
                preset[key] = value
        return preset

    def _part(self, part: Any) -> dict[str, Any]:
        if not isinstance(part, dict) or part.get("type") not in ("text", "audio"):
            raise ValueError(
                "each system_content part is {type: text, text} or {type: audio, path}"
            )
        if part["type"] == "text":
            return {"type": "text", "text": _text(part, "text", "")}
        return {"type": "audio", **self._audio_meta(_text(part, "path", ""))}

    def _inside(self, relative: str) -> Path | None:
        """The file `relative` names under the root, or None when it leaves the root."""
        root = self.root.resolve()
        path = (root / relative).resolve()
        return path if path.is_relative_to(root) else None

    def _audio_meta(self, relative: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"data": None, "path": relative, "name": Path(relative).name}
        path = self._inside(relative)
        duration = 0.0
        if path is None:
            log.warning("preset audio %s is outside %s: not used", relative, self.root)
        else:
            try:
                with wave.open(str(path)) as wav:
                    duration = wav.getnframes() / max(1, wav.getframerate())
            except (OSError, EOFError, wave.Error) as exc:
                log.warning("preset audio %s unreadable: %s", path, exc)
        meta["duration"] = round(duration, 1)
        return meta

    def _audio_body(self, meta: dict[str, Any]) -> dict[str, Any]:
        """{data (base64 float32 16 kHz), name, duration}; data null when unusable."""
        empty = {"data": None, "name": meta.get("name", ""), "duration": 0}
        path = self._inside(meta.get("path", ""))
        if path is None:
            return empty
        try:
            if path.stat().st_size > MAX_AUDIO_BYTES:
                raise InvalidPayload(f"larger than {MAX_AUDIO_BYTES} bytes")
            pcm = wav_to_pcm16k(path.read_bytes(), f"preset audio {path.name}")
        except (OSError, InvalidPayload) as exc:
            log.warning("preset audio %s unusable: %s", path, exc)
            return empty
        return {
            "data": base64.b64encode(pcm).decode("ascii"),
            "name": path.name,
            "duration": round(len(pcm) / 4 / 16000, 1),
        }


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from None


def _text(raw: dict[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str | int | float):
        raise ValueError(f"{key} must be text")
    return str(value)
