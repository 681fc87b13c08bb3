"""Worker settings: a frozen dataclass, read from OMNI_WORKER_* variables, CLI flags on top."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from omnifabric.worker.errors import ConfigError

T = TypeVar("T")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs; defaults suit a single-host deployment."""

    host: str = "127.0.0.1"
    """Interface the WorkerService listens on."""
    port: int = 22400
    """TCP port of the WorkerService; 0 picks any free port."""
    advertise_address: str | None = None
    """host:port the scheduler hands to edges; None = host:actual port."""
    scheduler_address: str = "127.0.0.1:50051"
    """host:port of the SchedulerService to register with."""
    worker_id: str = field(default_factory=_default_worker_id)
    """Stable id of this process among live workers (default hostname-pid)."""
    engine: str = "synthetic"
    """Engine name: synthetic, reference, minicpmo."""
    slots: int | None = None
    """Sessions held at once; None = the engine's default (synthetic: 4)."""
    audio_limit_s: float = 600.0
    """Duration limit of an audio session, seconds from its start."""
    video_limit_s: float = 300.0
    """Duration limit of a video session, seconds from its start."""
    max_context_tokens: int = 8192
    """Context cap in tokens; a session reaching it closes with CONTEXT_FULL."""
    lease_wait_s: float = 2.0
    """How long a Session waits for the scheduler's lease_granted to arrive."""
    register_backoff_s: float = 0.2
    """First delay before re-registering after the scheduler stream breaks (doubles)."""
    register_backoff_max_s: float = 2.0
    """Largest delay between registration attempts: a scheduler back after an outage has
    every worker again within this (plus one connect)."""
    synthetic_compute_ms: float = 40.0
    """Busy time per unit of the synthetic engine, milliseconds."""
    device: str | None = None
    """Torch device of the engine: cpu, cuda or cuda:N; None = the engine's default
    (reference: cpu, minicpmo: cuda)."""
    model_path: str | None = None
    """minicpmo: local directory of the openbmb/MiniCPM-o-4_5 checkpoint."""
    attn: str = "sdpa"
    """minicpmo: attention implementation, sdpa or flash_attention_2."""
    compile: bool = False
    """minicpmo: wrap the LLM forward in torch.compile (slower start, faster units)."""
    minicpmo_api: str = "auto"
    """minicpmo: which of the model code's layouts to drive: auto (the best the directory
    offers), unified, as_duplex or duplex."""
    text_only: bool = False
    """minicpmo: no speech output even where the vocoder could run (it is off by itself
    where it cannot: no CUDA, no minicpmo-utils, no assets/token2wav)."""
    default_voice: str | None = None
    """minicpmo: WAV of the voice for sessions without reference audio; None = the model
    directory's own reference audio, else a clip the project renders with espeak-ng."""
    turn_min_speech_s: float = 0.3
    """Reference engine: speech needed before a pause can end the user's turn, seconds."""
    turn_end_silence_s: float = 0.9
    """Reference engine: silence after speech that ends the user's turn, seconds."""
    llm_model: str | None = None
    """Reference engine: the reply model, a key of ``llm_gguf.MODELS``; None = its default."""
    llm_threads: int | None = None
    """Reference engine: CPU threads llama.cpp uses for replies; None = two where the
    machine has two cores or more (a reply's first words come ~40% sooner on an idle
    worker), else one."""
    synthetic_fail_unit: int | None = None
    """Fault injection (tests): the synthetic engine fails on this unit of every session."""
    synthetic_hang_unit: int | None = None
    """Fault injection (tests): the synthetic engine hangs (for an hour) in this unit of
    every session."""
    unit_timeout_s: float = 5.0
    """An engine call of one unit (prefill + generate, or finalize) running longer ends its
    session with error/inference_error, and the worker reports NOT_SERVING until the call
    returns (a stuck engine thread cannot be killed)."""
    memory_tolerance_mb: float = 16.0
    """GPU memory above the post-warm-up baseline tolerated once all sessions ended, MiB."""
    drain_grace_s: float = 10.0
    """Time open sessions get to end in-band on drain before the server stops."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest gRPC message sent or received, bytes."""
    metrics_port: int = 9160
    """Port of the Prometheus /metrics HTTP server (on `host`); 0 = any free port, -1 = off."""
    tls_ca: str | None = None
    """PEM CA: the scheduler's certificate is checked against it (TLS to the scheduler);
    with tls_cert/tls_key also set, edges must present a certificate it signed."""
    tls_cert: str | None = None
    """PEM certificate: the WorkerService speaks TLS only; also presented to a TLS scheduler."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        _check_range("slots", self.slots, 1, 4096, optional=True)
        _check_range("audio_limit_s", self.audio_limit_s, 0.001, 86400.0)
        _check_range("video_limit_s", self.video_limit_s, 0.001, 86400.0)
        _check_range("max_context_tokens", self.max_context_tokens, 1, 1 << 20)
        _check_range("lease_wait_s", self.lease_wait_s, 0.0, 60.0)
        _check_range("register_backoff_s", self.register_backoff_s, 0.001, 60.0)
        _check_range("register_backoff_max_s", self.register_backoff_max_s, 0.001, 600.0)
        _check_range("synthetic_compute_ms", self.synthetic_compute_ms, 0.0, 60000.0)
        _check_range("turn_min_speech_s", self.turn_min_speech_s, 0.032, 10.0)
        _check_range("turn_end_silence_s", self.turn_end_silence_s, 0.064, 10.0)
        _check_range("llm_threads", self.llm_threads, 1, 256, optional=True)
        _check_range("memory_tolerance_mb", self.memory_tolerance_mb, 0.0, 1 << 20)
        _check_range("drain_grace_s", self.drain_grace_s, 0.0, 3600.0)
        _check_range("unit_timeout_s", self.unit_timeout_s, 0.05, 3600.0)
        _check_range("synthetic_hang_unit", self.synthetic_hang_unit, 1, 1 << 30, optional=True)
        _check_range("max_message_bytes", self.max_message_bytes, 1024, 1 << 30)
        if not isinstance(self.metrics_port, int) or not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in -1..65535, got {self.metrics_port!r}")
        if not self.worker_id:
            raise ConfigError("worker_id must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "OMNI_FABRIC_TLS_CERT and OMNI_FABRIC_TLS_KEY "
                "(--fabric-tls-cert, --fabric-tls-key) must be set together"
            )
        if self.minicpmo_api not in ("auto", "unified", "as_duplex", "duplex"):
            raise ConfigError(
                "minicpmo_api must be auto, unified, as_duplex or duplex, "
                f"got {self.minicpmo_api!r}"
            )
        if self.attn not in ("sdpa", "flash_attention_2", "eager"):
            raise ConfigError(f"attn must be sdpa, flash_attention_2 or eager, got {self.attn!r}")
        device = self.device
        if device is not None and not (device in ("cpu", "cuda") or device.startswith("cuda:")):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """Read OMNI_WORKER_* variables; `overrides` (CLI flags) win. Raises ConfigError."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (var, parse) in _ENV.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[name] = parse(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not a valid {name}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(_name_variable(str(exc))) from None

    def with_overrides(self, **overrides: Any) -> WorkerConfig:
        """A copy with the given non-None fields replaced (CLI flags on top of env)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def limit_s(self, mode: str) -> float:
        """Duration limit in seconds for a session of `mode` ("audio" or "video")."""
        return self.video_limit_s if mode == "video" else self.audio_limit_s


def _check_port(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be in 0..65535, got {value!r}")


def _check_range(name: str, value: Any, low: float, high: float, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"{name} must be in {low}..{high}, got {value!r}")


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _optional_int(raw: str) -> int | None:
    return None if raw.lower() in ("", "auto", "none") else int(raw)


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "host": ("OMNI_WORKER_HOST", str),
    "port": ("OMNI_WORKER_PORT", int),
    "advertise_address": ("OMNI_WORKER_ADVERTISE", str),
    "scheduler_address": ("OMNI_WORKER_SCHEDULER", str),
    "worker_id": ("OMNI_WORKER_ID", str),
    "engine": ("OMNI_WORKER_ENGINE", str),
    "slots": ("OMNI_WORKER_SLOTS", _optional_int),
    "audio_limit_s": ("OMNI_WORKER_AUDIO_LIMIT_S", float),
    "video_limit_s": ("OMNI_WORKER_VIDEO_LIMIT_S", float),
    "max_context_tokens": ("OMNI_WORKER_MAX_CONTEXT_TOKENS", int),
    "lease_wait_s": ("OMNI_WORKER_LEASE_WAIT_S", float),
    "register_backoff_s": ("OMNI_WORKER_REGISTER_BACKOFF_S", float),
    "register_backoff_max_s": ("OMNI_WORKER_REGISTER_BACKOFF_MAX_S", float),
    "synthetic_compute_ms": ("OMNI_WORKER_COMPUTE_MS", float),
    "synthetic_fail_unit": ("OMNI_WORKER_SYNTHETIC_FAIL_UNIT", _optional_int),
    "synthetic_hang_unit": ("OMNI_WORKER_SYNTHETIC_HANG_UNIT", _optional_int),
    "unit_timeout_s": ("OMNI_WORKER_UNIT_TIMEOUT_S", float),
    "turn_min_speech_s": ("OMNI_WORKER_TURN_MIN_SPEECH_S", float),
    "device": ("OMNI_WORKER_DEVICE", str),
    "model_path": ("OMNI_WORKER_MODEL_PATH", str),
    "attn": ("OMNI_WORKER_ATTN", str),
    "compile": ("OMNI_WORKER_COMPILE", _flag),
    "minicpmo_api": ("OMNI_WORKER_MINICPMO_API", str),
    "text_only": ("OMNI_WORKER_TEXT_ONLY", _flag),
    "default_voice": ("OMNI_WORKER_DEFAULT_VOICE", str),
    "turn_end_silence_s": ("OMNI_WORKER_TURN_END_SILENCE_S", float),
    "llm_threads": ("OMNI_WORKER_LLM_THREADS", _optional_int),
    "llm_model": ("OMNI_WORKER_LLM_MODEL", str),
    "memory_tolerance_mb": ("OMNI_WORKER_MEMORY_TOLERANCE_MB", float),
    "drain_grace_s": ("OMNI_WORKER_DRAIN_GRACE_S", float),
    "max_message_bytes": ("OMNI_WORKER_MAX_MESSAGE_BYTES", int),
    "metrics_port": ("OMNI_WORKER_METRICS_PORT", int),
    "tls_ca": ("OMNI_FABRIC_TLS_CA", str),
    "tls_cert": ("OMNI_FABRIC_TLS_CERT", str),
    "tls_key": ("OMNI_FABRIC_TLS_KEY", str),
}


def _name_variable(message: str) -> str:
    """Prefix a range error with the variable that sets the field."""
    field_name = message.split(" ", 1)[0]
    var = _ENV.get(field_name, ("", str))[0]
    return f"{var} ({message})" if var else message
