"""Worker settings: a frozen dataclass read from OMNI_WORKER_* variables and flags
(omnifabric.common.config)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from omnifabric.common import config as settings
from omnifabric.common import listen, schedulers
from omnifabric.common.config import ConfigError, setting
from omnifabric.common.session_types import WINDOW_MODES, ContextWindow
from omnifabric.common.tls import FabricTls
from omnifabric.worker import headroom
from omnifabric.worker.journal import JOURNAL_RESULTS

ASR_CHOICES = ("both", "whisper")
"""The reference engine's recognizer settings (``WorkerConfig.asr``)."""
ASR_PRECISIONS = ("auto", "fp32")
"""The reference engine's recognizers' arithmetic (``WorkerConfig.asr_precision``)."""
SWITCHES = ("auto", "on", "off")
"""A three-way switch (``cuda_graphs``, ``vocoder_tf32``): auto leaves it to the device."""


def switch(name: str, value: str) -> str:
    """`value` of the switch `name`, or ValueError naming it (for the engines' own
    parameters, which are also set outside this config)."""
    if value not in SWITCHES:
        raise ValueError(f"{name} is {', '.join(SWITCHES[:-1])} or {SWITCHES[-1]}, not {value!r}")
    return value


TURN_WORK = ("auto", "inline", "finalize")
"""Where the reference engine works out the end of a user's turn (``WorkerConfig.turn_work``,
``TurnRules.turn_work``)."""
STUCK_MULTIPLE = 3.0
"""An engine call is stuck (its session ends with inference_error, the worker turns
NOT_SERVING until it returns) past the configured unit timeout (``unit_timeout_s``), or
past this many times the engine's own measure of its dearest call (Engine.slowest_call_s)
where that is longer. A CPU engine's finalize that ends a turn takes
1-3 s on a slow 2-core host and twice that while another session's call shares the cores:
the fixed 5 s ended healthy sessions there (CI, 2026-11-28: warm-up 37 s, finalizes past
5 s)."""


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig(FabricTls):
    """Everything one worker process needs; defaults suit a single-host deployment."""

    host: str = setting(
        "127.0.0.1", env="OMNI_WORKER_HOST", flag="--host", help="interface to listen on"
    )
    """Interface the WorkerService listens on."""
    port: int = setting(
        22400, env="OMNI_WORKER_PORT", flag="--port", range=(0, 65535), help="port, 0 = any free"
    )
    """TCP port of the WorkerService; 0 picks any free port."""
    advertise_address: str | None = setting(
        None,
        env="OMNI_WORKER_ADVERTISE",
        flag="--advertise",
        help="host:port edges dial (default host:actual port; set it when binding 0.0.0.0)",
    )
    """host:port the scheduler hands to edges; None = host:actual port."""
    scheduler_address: str = setting(
        "127.0.0.1:50051",
        env="OMNI_WORKER_SCHEDULER",
        flag="--scheduler",
        help="scheduler host:port; active/standby schedulers: several, comma-separated",
    )
    """host:port of the SchedulerService to register with; with active/standby schedulers,
    all of them comma-separated: the worker registers with whichever leads."""
    worker_id: str = setting(
        env="OMNI_WORKER_ID",
        flag="--worker-id",
        help="stable worker id (default hostname-pid)",
        default_factory=_default_worker_id,
    )
    """Stable id of this process among live workers (default hostname-pid)."""
    engine: str = setting(
        "synthetic",
        env="OMNI_WORKER_ENGINE",
        flag="--engine",
        help="synthetic, reference or minicpmo (omnifabric serve: reference)",
    )
    """Engine name: synthetic, reference, minicpmo."""
    slots: int | None = setting(
        None,
        env="OMNI_WORKER_SLOTS",
        flag="--slots",
        range=(1, 4096),
        help="sessions at once (default: the engine's: reference as many audio sessions as "
        "keep real time by its warm-up, synthetic 4, minicpmo 1)",
    )
    """Sessions held at once; None = the engine's default (synthetic: 4)."""
    audio_limit_s: float = setting(
        600.0,
        env="OMNI_WORKER_AUDIO_LIMIT_S",
        flag="--audio-limit-s",
        range=(0.0, 86400.0),
        help="audio session limit, s (0: none)",
    )
    """Duration limit of an audio session, seconds from its start; 0: no limit."""
    video_limit_s: float = setting(
        300.0,
        env="OMNI_WORKER_VIDEO_LIMIT_S",
        flag="--video-limit-s",
        range=(0.0, 86400.0),
        help="video session limit, s (0: none)",
    )
    """Duration limit of a video session, seconds from its start; 0: no limit."""
    max_context_tokens: int = setting(
        8192,
        env="OMNI_WORKER_MAX_CONTEXT_TOKENS",
        flag="--max-context-tokens",
        range=(1, 1 << 20),
        help="context cap, tokens",
    )
    """Context cap in tokens; a session reaching it closes with CONTEXT_FULL (sessions with
    a context window slide below it instead)."""
    context_window: str = setting(
        "off",
        env="OMNI_WORKER_CONTEXT_WINDOW",
        flag="--context-window",
        choices=WINDOW_MODES,
        help="how a full context slides: off (close with context_full), basic, context",
    )
    """Sessions' context window unless they choose their own (ContextWindow)."""
    window_high_tokens: int = setting(
        ContextWindow.high_tokens,
        env="OMNI_WORKER_WINDOW_HIGH_TOKENS",
        flag="--window-high-tokens",
        range=(2, 1 << 20),
        help="basic window: slide once the context passes this many tokens",
    )
    window_low_tokens: int = setting(
        ContextWindow.low_tokens,
        env="OMNI_WORKER_WINDOW_LOW_TOKENS",
        flag="--window-low-tokens",
        range=(1, 1 << 20),
        help="basic window: what a slide keeps, tokens",
    )
    window_units: int = setting(
        ContextWindow.units,
        env="OMNI_WORKER_WINDOW_UNITS",
        flag="--window-units",
        range=(1, 1 << 20),
        help="context window: units kept",
    )
    window_previous_tokens: int = setting(
        ContextWindow.previous_tokens,
        env="OMNI_WORKER_WINDOW_PREVIOUS_TOKENS",
        flag="--window-previous-tokens",
        range=(0, 1 << 20),
        help="context window: tokens of earlier replies carried forward",
    )
    lease_wait_s: float = setting(
        2.0,
        env="OMNI_WORKER_LEASE_WAIT_S",
        range=(0.0, 60.0),
        help="how long a Session waits for its lease grant to arrive, s",
    )
    """How long a Session waits for the scheduler's lease_granted to arrive."""
    register_backoff_s: float = setting(
        0.2,
        env="OMNI_WORKER_REGISTER_BACKOFF_S",
        range=(0.001, 60.0),
        help="first delay before registering again after the scheduler stream breaks (doubles), s",
    )
    """First delay before re-registering after the scheduler stream breaks (doubles)."""
    register_backoff_max_s: float = setting(
        2.0,
        env="OMNI_WORKER_REGISTER_BACKOFF_MAX_S",
        range=(0.001, 600.0),
        help="longest delay between registration attempts (re-registration after a "
        "scheduler restart), s",
    )
    """Largest delay between registration attempts: a scheduler back after an outage has
    every worker again within this (plus one connect)."""
    headroom_window_s: float = setting(
        headroom.WINDOW_S,
        env="OMNI_WORKER_HEADROOM_WINDOW_S",
        flag="--headroom-window",
        range=(0.5, 3600.0),
        help="seconds of recent units the real-time headroom counts (late units, costs)",
    )
    """The worker's real-time headroom (worker.headroom) counts the units of the last this
    many seconds: a late unit among them holds new sessions back, and their costs say what a
    session costs. Shorter recovers sooner from a slow spell; longer remembers it longer."""
    batching: str = setting(
        "on",
        env="OMNI_WORKER_BATCHING",
        flag="--batching",
        choices=("on", "off"),
        help="serve sessions in batched steps where the engine can (off: one by one)",
    )
    """on: an engine that serves one unit of several sessions in one call (Engine.stepper)
    runs every session's units in batched steps (worker.batcher); off: sessions take turns
    on the engine threads, one unit at a time (time-sliced), as engines without it always
    do."""
    batch_window_ms: float = setting(
        10.0,
        env="OMNI_WORKER_BATCH_WINDOW_MS",
        flag="--batch-window-ms",
        range=(0.0, 1000.0),
        help="batched steps: how long a unit waits at most for batch-mates, ms",
    )
    """Batched steps: the oldest waiting unit waits at most this long for units of other
    sessions to join its step (not at all once every open session has one waiting)."""
    synthetic_batch_share: float | None = setting(
        None,
        env="OMNI_WORKER_BATCH_SHARE",
        flag="--batch-share",
        range=(0.0, 1.0),
        help="synthetic engine: offer batched steps, each extra session adding this share of a "
        "unit's compute",
    )
    """Synthetic engine: offer batched steps, a step of N sessions costing the compute of
    one unit times 1 + share x (N - 1) (finalizes likewise); None: no batched entry."""
    synthetic_compute_ms: float = setting(
        40.0,
        env="OMNI_WORKER_COMPUTE_MS",
        flag="--compute-ms",
        range=(0.0, 60000.0),
        help="synthetic engine's busy time per unit, ms",
    )
    """Busy time per unit of the synthetic engine, milliseconds."""
    synthetic_finalize_ms: float = setting(
        0.0,
        env="OMNI_WORKER_FINALIZE_MS",
        flag="--finalize-ms",
        range=(0.0, 60000.0),
        help="synthetic engine's busy time per deferred finalize (a unit arriving meanwhile "
        "waits: reported as finalize_wait_ms), ms",
    )
    """Busy time of the synthetic engine's deferred finalize after each unit, milliseconds
    (a real engine makes the next second of speech there; a unit that arrives meanwhile
    waits for it)."""
    synthetic_threads: int | None = setting(
        None,
        env="OMNI_WORKER_ENGINE_THREADS",
        flag="--engine-threads",
        range=(1, 1024),
        help="synthetic engine threads (default: one per slot; fewer time-slice the sessions)",
    )
    """Threads the synthetic engine serves units on; fewer than the slots time-slice the
    sessions, as a GPU engine does (capacity tests)."""
    synthetic_cpu_bound: bool = setting(
        False,
        env="OMNI_WORKER_CPU_BOUND",
        flag="--cpu-bound",
        help="synthetic engine spends its compute as CPU time instead of sleeping",
    )
    """The synthetic engine's compute spins on the CPU (a neighbour on its core slows it)."""
    device: str | None = setting(
        None,
        env="OMNI_WORKER_DEVICE",
        flag="--device",
        help="cpu, cuda or cuda:N (default: the engine's: reference cpu, minicpmo cuda)",
    )
    """Torch device of the engine: cpu, cuda or cuda:N; None = the engine's default
    (reference: cpu, minicpmo: cuda)."""
    model_path: str | None = setting(
        None,
        env="OMNI_WORKER_MODEL_PATH",
        flag=("--model-dir", "--model-path"),
        help="minicpmo: local MiniCPM-o 4.5 checkpoint directory",
    )
    """minicpmo: local directory of the openbmb/MiniCPM-o-4_5 checkpoint."""
    attn: str = setting(
        "sdpa",
        env="OMNI_WORKER_ATTN",
        flag="--attn",
        choices=("sdpa", "flash_attention_2", "eager"),
        help="minicpmo: attention implementation",
    )
    """minicpmo: attention implementation, sdpa or flash_attention_2."""
    compile: bool = setting(
        False, env="OMNI_WORKER_COMPILE", flag="--compile", help="minicpmo: torch.compile the LLM"
    )
    """minicpmo: wrap the LLM forward in torch.compile (slower start, faster units)."""
    cuda_graphs: str = setting(
        "auto",
        env="OMNI_WORKER_CUDA_GRAPHS",
        flag="--cuda-graphs",
        choices=SWITCHES,
        help="minicpmo: batched decode forwards and vocoder flow steps in static shapes "
        "replayed as CUDA graphs",
    )
    """minicpmo: the batched step's decode forwards and its batched vocoder's flow-matching
    steps padded to bucketed static shapes and, on CUDA, captured and replayed as CUDA graphs
    (auto: on where the device is CUDA; on a CPU, on runs the static shapes eagerly; off: the
    ragged forwards)."""
    vocoder_tf32: str = setting(
        "auto",
        env="OMNI_WORKER_VOCODER_TF32",
        flag="--vocoder-tf32",
        choices=SWITCHES,
        help="minicpmo: the vocoder flow's float32 matrix products in TF32 on CUDA (auto: "
        "unless the weights are float32)",
    )
    """minicpmo: the vocoder's flow (float32 whatever the weights) runs its matrix products
    in TF32 on CUDA: it is ~88 GFLOP a speaker and second of audio, which full float32 runs
    at a seventh of the tensor cores' rate (vocoder.precision; the HiFT stays in float32).
    auto: on where the device is CUDA and the weights are not float32 (a float32 engine
    means float32 throughout); off: full float32. PyTorch runs convolutions in TF32 either
    way (its default)."""
    slot_spare_tokens: int | None = setting(
        None,
        env="OMNI_WORKER_SLOT_SPARE_TOKENS",
        flag="--slot-spare-tokens",
        range=(64, 1 << 16),
        help="minicpmo: tokens a batched LLM slot holds past the context it keeps, for the "
        "unit that crosses it (default 1024)",
    )
    """minicpmo: room in each batched LLM slot beyond the context a session keeps (the cap,
    or a basic window's high watermark) for the unit that crosses it: an audio unit adds at
    most ~40 tokens, a camera frame its slices' tokens (64 a slice). None: 1024, enough for
    a unit with a frame at most slices. A unit that would pass it runs through the serial
    path. A worker without video can set 128: 126 MiB less a slot at the released sizes
    (144 KiB a token), 15.75 GiB at 128 slots."""
    tts_slot_tokens: int | None = setting(
        None,
        env="OMNI_WORKER_TTS_SLOT_TOKENS",
        flag="--tts-slot-tokens",
        range=(256, 1 << 16),
        help="minicpmo: tokens of a batched TTS slot, a speaker's TTS past within a reply "
        "(default 4096)",
    )
    """minicpmo: each batched session's TTS slot (a row of the TTS's KV cache, claimed at its
    first speaking step): its TTS past within one reply, ~47 tokens a second of speech
    (the unit's spoken tokens, the audio bos, 26 codes). None: 4096 (~87 s of continuous
    speech; 240 MiB a slot at the released sizes), or less where the TTS backbone's
    positions end sooner. A reply that would outgrow it goes on on the serial path until
    it ends. 2048 halves the TTS's memory (120 MiB a slot: 15 GiB less at 128 slots)."""
    decode_ahead: int | None = setting(
        None,
        env="OMNI_WORKER_DECODE_AHEAD",
        flag="--decode-ahead",
        range=(0, 8),
        help="minicpmo: batched decode forwards the GPU runs before the host reads their "
        "tokens (default: 1 on CUDA, 0 elsewhere)",
    )
    """minicpmo: how many decode forwards the batched step's device runs beyond the host's
    reading of their tokens (decode.py: the host's rules for a forward run while the next
    ones compute; a row that ended is taken back); 0: the host reads each forward's tokens
    before the next. None: 1 on CUDA, 0 elsewhere."""
    minicpmo_api: str = setting(
        "auto",
        env="OMNI_WORKER_MINICPMO_API",
        flag="--minicpmo-api",
        choices=("auto", "unified", "as_duplex", "duplex"),
        help="minicpmo: the model code layout to drive",
    )
    """minicpmo: which of the model code's layouts to drive: auto (the best the directory
    offers), unified, as_duplex or duplex."""
    text_only: bool = setting(
        False, env="OMNI_WORKER_TEXT_ONLY", flag="--text-only", help="minicpmo: no speech output"
    )
    """minicpmo: no speech output even where the vocoder could run (it is off by itself
    where it cannot: no minicpmo-utils, no assets/token2wav)."""
    serial_vocoder: bool = setting(
        False,
        env="OMNI_WORKER_SERIAL_VOCODER",
        flag="--serial-vocoder",
        help="minicpmo: the batched step runs the vocoder per speaking session, not batched",
    )
    """minicpmo: in a batched step, run the vocoder once per speaking session through the
    model code's own waveform method instead of once for all speakers (for comparison)."""
    default_voice: str | None = setting(
        None,
        env="OMNI_WORKER_DEFAULT_VOICE",
        flag="--default-voice",
        help="minicpmo: WAV voice for sessions without reference audio",
    )
    """minicpmo: WAV of the voice for sessions without reference audio; None = the model
    directory's own reference audio, else a clip the project renders with espeak-ng."""
    turn_min_speech_s: float = setting(
        0.3,
        env="OMNI_WORKER_TURN_MIN_SPEECH_S",
        range=(0.032, 10.0),
        help="reference engine: speech needed before a pause can end the user's turn, s",
    )
    """Reference engine: speech needed before a pause can end the user's turn, seconds."""
    turn_end_silence_s: float = setting(
        0.9,
        env="OMNI_WORKER_TURN_END_SILENCE_S",
        range=(0.064, 10.0),
        help="reference engine: silence that ends the user's turn whatever was said, s",
    )
    """Reference engine: silence after speech that ends the user's turn, seconds."""
    asr: str = setting(
        "both",
        env="OMNI_WORKER_ASR",
        flag="--asr",
        choices=ASR_CHOICES,
        help="reference: recognizers, both (Whisper base and Moonshine base-en, the likelier "
        "transcript) or whisper (Whisper base alone: less CPU and memory, more mishearings)",
    )
    """Reference engine: ``both`` hears every utterance with Whisper base and Moonshine
    base-en and keeps the transcript both find likelier (``hearing.Ears``); ``whisper`` uses
    Whisper base alone (less CPU and ~250 MB less memory, more mishearings)."""
    asr_precision: str = setting(
        "auto",
        env="OMNI_WORKER_ASR_PRECISION",
        flag="--asr-precision",
        choices=ASR_PRECISIONS,
        help="reference: auto (the recognizers' encoders in bfloat16 where the CPU computes "
        "it natively: AVX512-BF16 or AMX) or fp32 (everywhere)",
    )
    """Reference engine, on CPU: ``auto`` runs the linear layers of Whisper base's and
    Moonshine base-en's encoders in bfloat16 where the CPU computes it natively
    (``linears.wants_bf16``; their decoders stay fp32); ``fp32`` keeps every layer in fp32 on
    any CPU."""
    turn_work: str = setting(
        "auto",
        env="OMNI_WORKER_TURN_WORK",
        flag="--turn-work",
        choices=TURN_WORK,
        help="reference: where a user turn's end is worked out: auto (inline when its measured "
        "cost fits 0.9 of a unit, else in that unit's finalize; always in the finalize for a "
        "client that takes results between units, which sends the reply's start as soon as it "
        "is made), inline or finalize (the same unit speaks for the same audio whatever the "
        "machine's speed: replays match)",
    )
    """Reference engine: ``TurnRules.turn_work``. ``auto`` decides by the engine's measured
    costs, which it learns as it runs, so a replay on a warmer or faster engine may start a
    reply a unit sooner than the recording did; ``finalize`` or ``inline`` never does."""
    llm_model: str | None = setting(
        None,
        env="OMNI_WORKER_LLM_MODEL",
        flag="--llm-model",
        help="reference: reply model, qwen2.5-coder-1.5b (default), qwen2.5-coder-0.5b or "
        "smollm2-135m",
    )
    """Reference engine: the reply model, a key of ``llm_gguf.MODELS``; None = its default."""
    llm_threads: int | None = setting(
        None,
        env="OMNI_WORKER_LLM_THREADS",
        flag="--llm-threads",
        range=(1, 256),
        help="reference: llama.cpp threads (default: 2 on a machine with 2 cores or more, else 1)",
    )
    """Reference engine: CPU threads llama.cpp uses for replies; None = two where the
    machine has two cores or more (a reply's first words come ~40% sooner on an idle
    worker), else one."""
    synthetic_fail_unit: int | None = setting(
        None,
        env="OMNI_WORKER_SYNTHETIC_FAIL_UNIT",
        flag="--fail-unit",
        help="fault injection: synthetic engine fails on unit N",
    )
    """Fault injection (tests): the synthetic engine fails on this unit of every session."""
    synthetic_hang_unit: int | None = setting(
        None,
        env="OMNI_WORKER_SYNTHETIC_HANG_UNIT",
        flag="--hang-unit",
        range=(1, 1 << 30),
        help="fault injection: synthetic engine hangs in unit N",
    )
    """Fault injection (tests): the synthetic engine hangs (for an hour) in this unit of
    every session."""
    journal_results: int = setting(
        JOURNAL_RESULTS,
        env="OMNI_WORKER_JOURNAL_RESULTS",
        flag="--journal-results",
        range=(1, 10_000_000),
        help="results a session's resume journal keeps whole; older ones only their shape",
    )
    """A resumable session's journal keeps its newest results whole (~2 KB each without
    speech, the newest 120 with it) and older ones as 9 bytes each: a resume that would
    have to send one of those again is refused (resume_expired)."""
    unit_timeout_s: float = setting(
        5.0,
        env="OMNI_WORKER_UNIT_TIMEOUT_S",
        flag="--unit-timeout",
        range=(0.05, 3600.0),
        help="an engine call of one unit running longer than this, from when an engine thread "
        "takes it up, ends its session (inference_error); the worker is NOT_SERVING until the "
        f"call returns; an engine that measures its dearest call gets {STUCK_MULTIPLE:g} times "
        "that where longer, s",
    )
    """An engine call of one unit (prefill + generate, or finalize) running longer, counted
    from when an engine thread takes it up (a wait for a free thread is not the call's),
    ends its session with error/inference_error, and the worker reports NOT_SERVING until
    the call returns (a stuck engine thread cannot be killed). An engine that measures its
    dearest call (the reference engine: the finalize that ends a 25 s turn, from its warm-up
    on) gets STUCK_MULTIPLE times that where it is longer: a CPU engine on a slow host ends
    turns in seconds."""
    memory_tolerance_mb: float = setting(
        16.0,
        env="OMNI_WORKER_MEMORY_TOLERANCE_MB",
        range=(0.0, 1 << 20),
        help="GPU memory above the post-warm-up baseline once all sessions ended beyond "
        "which the worker turns NOT_SERVING, MiB",
    )
    """GPU memory above the post-warm-up baseline tolerated once all sessions ended, MiB."""
    drain_grace_s: float = setting(
        10.0,
        env="OMNI_WORKER_DRAIN_GRACE_S",
        flag="--grace",
        range=(0.0, 3600.0),
        help="on SIGTERM: time sessions get to end in-band, s",
    )
    """Time open sessions get to end in-band on drain before the server stops."""
    max_message_bytes: int = setting(
        16 * 1024 * 1024,
        env="OMNI_WORKER_MAX_MESSAGE_BYTES",
        flag="--max-message-bytes",
        range=(1024, 1 << 30),
        help="largest gRPC message either way",
    )
    """Largest gRPC message sent or received, bytes."""
    metrics_port: int = setting(
        9160,
        env="OMNI_WORKER_METRICS_PORT",
        flag="--metrics-port",
        range=(-1, 65535),
        help="Prometheus /metrics port, 0 = any free, -1 = off",
    )
    """Port of the Prometheus /metrics HTTP server (on `host`); 0 = any free port, -1 = off."""

    def __post_init__(self) -> None:
        settings.check(self)
        if not self.worker_id:
            raise ConfigError("OMNI_WORKER_ID", "must not be empty")
        try:
            schedulers.addresses(self.scheduler_address)
        except ValueError as exc:
            raise ConfigError("OMNI_WORKER_SCHEDULER", str(exc)) from None
        if self.advertise_address is not None:
            try:
                listen.check_address(self.advertise_address)
            except ValueError as exc:
                raise ConfigError("OMNI_WORKER_ADVERTISE", str(exc)) from None
        self.check_fabric_tls()
        device = self.device
        if device is not None and not (device in ("cpu", "cuda") or device.startswith("cuda:")):
            raise ConfigError("OMNI_WORKER_DEVICE", f"must be cpu, cuda or cuda:N, got {device!r}")
        refusal = self.window().refusal(self.max_context_tokens)
        if refusal:
            raise ConfigError("OMNI_WORKER_WINDOW_* (--window-*)", refusal)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """Read OMNI_WORKER_* variables; `overrides` (flags: field -> value, None = not
        given) win. Raises ConfigError naming the variable or flag."""
        return settings.load(cls, environ, flags=overrides)

    def with_overrides(self, **overrides: Any) -> WorkerConfig:
        """A copy with the given non-None fields replaced (CLI flags on top of env)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def limit_s(self, mode: str) -> float:
        """Duration limit in seconds for a session of `mode` ("audio" or "video"); 0: none."""
        return self.video_limit_s if mode == "video" else self.audio_limit_s

    def window(self) -> ContextWindow:
        """The operator's context window, fitted under the context cap."""
        return ContextWindow(
            mode=self.context_window,
            high_tokens=self.window_high_tokens,
            low_tokens=self.window_low_tokens,
            units=self.window_units,
            previous_tokens=self.window_previous_tokens,
        ).within(self.max_context_tokens)
