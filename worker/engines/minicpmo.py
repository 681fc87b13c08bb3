"""The MiniCPM-o 4.5 engine: the production model on CUDA, driven through its own API.

Nothing of the model is copied here: the checkpoint directory carries the model's code
(loaded with trust_remote_code) and this module only calls the loaded model, with the
call shapes ../shared/MODELS.md documents:
- load: AutoModel.from_pretrained(dir, trust_remote_code=True, torch_dtype=bfloat16,
  attn_implementation=...), .eval(), .to(device); init_unified(pt_path=None,
  preload_both_tts=True, duplex_config={...}, device=..., chat_vocoder="token2wav");
- per session: set_mode(DUPLEX) (clears the KV cache); duplex_prepare(
  prefix_system_prompt, suffix_system_prompt, ref_audio, prompt_wav_path);
- per unit: duplex_prefill(audio_waveform, frame_list, max_slice_nums), then
  duplex_generate(...every sampling argument explicit...), then, deferred,
  duplex_finalize() before the next prefill; duplex_set_break() when force_listen
  interrupts speech; duplex_stop() at the end; the KV length from
  model.duplex.decoder.get_cache_length();
- chat: set_mode(CHAT), chat(msgs=..., tokenizer=..., generate_audio=...,
  use_tts_template=..., ...).
The model holds one duplex state, so a worker serves one session per GPU.
"""

from __future__ import annotations

import enum
import importlib.metadata
import io
import logging
import os
import sys
import tempfile
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from worker.engine import (
    ChatChunk,
    ChatMessage,
    ChatTurn,
    DuplexSettings,
    Engine,
    EngineSession,
    GenerateResult,
)
from worker.errors import EngineUnavailable

log = logging.getLogger("omnifabric.worker.minicpmo")

#: The model's code needs transformers 4.51.x (it fails on 5.x).
TRANSFORMERS_SERIES = "4.51."
#: How the reference server wraps the system prompt around the LLM reference audio.
PREFIX_TEMPLATE = "<|im_start|>system\n{text}\n<|audio_start|>"
SUFFIX = "<|audio_end|><|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
#: The first prefill wants 1.035 s of audio; a 1 s first unit is padded at its start.
FIRST_CHUNK_SAMPLES = 16560
#: Per unit the model speaks at most this many tokens (MODELS.md: 20 tokens, 28 chars).
MAX_SPEAK_TOKENS = 20
#: Startup protection: the model's first units listen.
FORCE_LISTEN_COUNT = 3
#: Context tokens per unit of audio input (~10 audio tokens at 10 per second).
AUDIO_TOKENS_PER_UNIT = 10
#: Vision tokens per image slice (the resampler's queries), for usage accounting.
VISION_TOKENS_PER_SLICE = 64
#: Sampling defaults of the reference server; duplex_generate's None defaults crash.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "decode_mode": "sampling",
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "listen_prob_scale": 1.0,
    "listen_top_k": None,
    "text_repetition_penalty": 1.05,
    "text_repetition_window_size": 512,
    "length_penalty": 1.1,
}


def check_model_dir(path: str | os.PathLike[str] | None) -> Path:
    """The checkpoint directory, checked for what loading needs. Raises EngineUnavailable
    naming the first thing missing."""
    if not path:
        raise EngineUnavailable("engine 'minicpmo' needs --model-path DIR (the checkpoint)")
    root = Path(path)
    if not root.is_dir():
        raise EngineUnavailable(f"model path {root} is not a directory")
    if not (root / "config.json").is_file():
        raise EngineUnavailable(f"{root} has no config.json: not a Hugging Face checkpoint")
    if not any(root.glob("*.safetensors")) and not (root / "model.safetensors.index.json").exists():
        raise EngineUnavailable(f"{root} has no *.safetensors weights")
    if not any(root.glob("modeling_*.py")):
        raise EngineUnavailable(f"{root} has no modeling_*.py: the model's own code is missing")
    if not (root / "assets" / "token2wav").is_dir():
        raise EngineUnavailable(f"{root} has no assets/token2wav (the chat vocoder)")
    return root


def check_runtime(device: str, transformers_version: str | None = None) -> None:
    """transformers 4.51.x and a usable CUDA device. Raises EngineUnavailable."""
    version = transformers_version or importlib.metadata.version("transformers")
    if not version.startswith(TRANSFORMERS_SERIES):
        raise EngineUnavailable(
            f"MiniCPM-o 4.5 needs transformers {TRANSFORMERS_SERIES}x, found {version}"
        )
    if not device.startswith("cuda"):
        raise EngineUnavailable(f"engine 'minicpmo' runs on CUDA, not on {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable("engine 'minicpmo' needs CUDA: torch.cuda.is_available() is False")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise EngineUnavailable(
            f"device {device} does not exist ({torch.cuda.device_count()} CUDA devices)"
        )


def mode_constant(model: Any, name: str) -> Any:
    """The model's own mode value for DUPLEX / CHAT / STREAMING: a module-level constant
    or an enum member in the model's module; else the lower-case name."""
    module = sys.modules.get(type(model).__module__)
    if module is not None:
        value = getattr(module, name, None)
        if value is not None:
            return value
        for item in vars(module).values():
            if isinstance(item, type) and issubclass(item, enum.Enum) and name in item.__members__:
                return item[name]
    return name.lower()


def wav_file(pcm: np.ndarray, rate: int = 16000) -> str:
    """Write float32 PCM to a temporary 16-bit WAV (the model takes the TTS voice as a
    path); the caller deletes it."""
    fd, path = tempfile.mkstemp(prefix="omni-voice-", suffix=".wav")
    with os.fdopen(fd, "wb") as raw, wave.open(raw, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def _ms(costs: dict[str, Any]) -> dict[str, float]:
    """The model's cost_* figures (seconds) as milliseconds keyed without the prefix."""
    out = {}
    for key, value in costs.items():
        if key.startswith("cost_") and isinstance(value, int | float):
            out[key[5:]] = float(value) * 1000.0
    return out


def _images(frames: list[bytes]) -> list[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]


class MiniCPMOSession(EngineSession):
    """One duplex session on the model (the model's duplex state is this session's)."""

    def __init__(self, engine: MiniCPMOEngine, session_id: str, mode: str) -> None:
        self.engine = engine
        self.model = engine.model
        self.session_id = session_id
        self.mode = mode
        self.settings = DuplexSettings()
        self.units = 0
        self.speaking = False
        self.output_tokens = 0
        self.voice_path: str | None = None
        self.vision_tokens = 0
        self.closed = False

    def prepare(self, system_prompt, ref_audio, tts_ref_audio, config: DuplexSettings) -> int:
        self.settings = config
        model = self.model
        model.set_mode(mode_constant(model, "DUPLEX"))
        self._apply_chunk_limits(config)
        voice = tts_ref_audio if tts_ref_audio is not None else ref_audio
        self.voice_path = wav_file(voice) if voice is not None and voice.size else None
        model.duplex_prepare(
            prefix_system_prompt=PREFIX_TEMPLATE.format(
                text=system_prompt.strip() or DEFAULT_SYSTEM_PROMPT
            ),
            suffix_system_prompt=SUFFIX,
            ref_audio=ref_audio if ref_audio is not None and ref_audio.size else None,
            prompt_wav_path=self.voice_path,
        )
        return self.kv_cache_length()

    def _apply_chunk_limits(self, config: DuplexSettings) -> None:
        """Per-session speak-token and startup-listen counts live on the model's duplex
        state when it exposes them (best effort: the documented API has no argument)."""
        duplex = getattr(self.model, "duplex", None)
        if duplex is None:
            return
        if config.max_new_speak_tokens_per_chunk and hasattr(
            duplex, "max_new_speak_tokens_per_chunk"
        ):
            duplex.max_new_speak_tokens_per_chunk = config.max_new_speak_tokens_per_chunk
        if config.force_listen_count is not None and hasattr(duplex, "force_listen_count"):
            duplex.force_listen_count = config.force_listen_count

    def prefill(
        self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int
    ) -> dict[str, float]:
        if self.units == 0 and pcm.size < FIRST_CHUNK_SAMPLES:
            pcm = np.concatenate([np.zeros(FIRST_CHUNK_SAMPLES - pcm.size, np.float32), pcm])
        images = _images(frames) if frames else []
        self.vision_tokens = len(images) * max(1, max_slice_nums) * VISION_TOKENS_PER_SLICE
        out = self.model.duplex_prefill(
            audio_waveform=pcm.astype(np.float32, copy=False),
            frame_list=images,
            max_slice_nums=max(1, max_slice_nums),
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"duplex_prefill failed: {out.get('reason', 'no reason given')}")
        return _ms(out) if isinstance(out, dict) else {}

    def generate(self, force_listen: bool) -> GenerateResult:
        self.units += 1
        s = self.settings
        startup = s.force_listen_count if s.force_listen_count is not None else FORCE_LISTEN_COUNT
        capped = s.max_tokens is not None and self.output_tokens >= s.max_tokens
        force = force_listen or self.units <= startup or capped
        if force_listen and self.speaking:
            self.model.duplex_set_break()  # stop the speech in flight; the turn closes
        out = self.model.duplex_generate(**self.sampling(force))
        is_listen = bool(out.get("is_listen", True))
        audio = np.asarray(out.get("audio_waveform", ()), dtype=np.float32).reshape(-1)
        if is_listen or s.tts_enabled is False:
            audio = np.zeros(0, np.float32)  # a listening unit carries 1 s of zeros
        end = bool(out.get("end_of_turn", False))
        self.speaking = not is_listen and not end
        n_tokens = int(out.get("n_tokens", 0) or 0)
        self.output_tokens += n_tokens
        return GenerateResult(
            is_listen=is_listen,
            text="" if is_listen else str(out.get("text", "") or ""),
            audio=audio,
            end_of_turn=end,
            kv_cache_length=self.kv_cache_length(),
            costs_ms=_ms(out),
            n_tokens=n_tokens,
            n_tts_tokens=int(out.get("n_tts_tokens", 0) or 0),
            input_audio_tokens=AUDIO_TOKENS_PER_UNIT,
            input_vision_tokens=self.vision_tokens,
        )

    def sampling(self, force_listen: bool) -> dict[str, Any]:
        """Every duplex_generate argument, explicit: session config over the defaults."""
        s = self.settings
        args = dict(SAMPLING_DEFAULTS)
        for key in ("temperature", "top_k", "top_p", "listen_prob_scale", "length_penalty"):
            value = getattr(s, key)
            if value is not None:
                args[key] = value
        args["force_listen_override"] = force_listen
        return args

    def kv_cache_length(self) -> int:
        return int(self.model.duplex.decoder.get_cache_length())

    def finalize(self) -> None:
        self.model.duplex_finalize()

    def stop(self) -> None:
        self.model.duplex_stop()
        self.speaking = False

    def close(self) -> None:
        """Free the session: the model's cleanup when it has one (KV and TTS caches), the
        voice file; the worker then runs gc + torch.cuda.empty_cache() and checks memory."""
        if self.closed:
            return
        self.closed = True
        cleanup = getattr(self.model, "duplex_cleanup", None)
        try:
            if callable(cleanup):
                cleanup()
        finally:
            if self.voice_path:
                Path(self.voice_path).unlink(missing_ok=True)
            self.engine.release(self)


class MiniCPMOEngine(Engine):
    """MiniCPM-o 4.5 from a local checkpoint on one CUDA device; one session at a time."""

    name = "minicpmo"
    modes = frozenset({"audio", "video", "chat"})
    default_slots = 1
    concurrency = 1

    def __init__(
        self,
        model_path: str | None = None,
        device: str = "cuda",
        attn: str = "sdpa",
        compile: bool = False,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        self.model_path = model_path
        self.device = device
        self.attn = attn
        self.compile = compile
        self.model = model
        """The loaded model; tests pass a recording double instead of loading."""
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._active: MiniCPMOSession | None = None

    @classmethod
    def from_config(cls, config: Any) -> MiniCPMOEngine:
        engine = cls(config.model_path, config.device or "cuda", config.attn, config.compile)
        if config.slots not in (None, 1):
            raise EngineUnavailable("engine 'minicpmo' holds one session per GPU: use --slots 1")
        return engine

    def load(self) -> None:
        """Check the checkpoint and the runtime, then load and initialise the model.
        Raises EngineUnavailable with what is wrong (before any weights are read)."""
        if self.model is not None:
            return
        root = check_model_dir(self.model_path)
        check_runtime(self.device)
        import torch
        from transformers import AutoModel, AutoTokenizer

        log.info("loading MiniCPM-o 4.5 from %s on %s (%s)", root, self.device, self.attn)
        model = AutoModel.from_pretrained(
            str(root),
            trust_remote_code=True,
            torch_dtype=torch.bfloat16,
            attn_implementation=self.attn,
        )
        model = model.eval().to(self.device)
        model.init_unified(
            pt_path=None,
            preload_both_tts=True,
            duplex_config={"max_new_speak_tokens_per_chunk": MAX_SPEAK_TOKENS},
            device=self.device,
            chat_vocoder="token2wav",
        )
        if self.compile and hasattr(model, "llm"):
            model.llm.forward = torch.compile(model.llm.forward)
        self.tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=True)
        self.model = model

    def open_session(self, session_id: str, mode: str) -> MiniCPMOSession:
        if mode not in ("audio", "video"):
            raise ValueError(f"mode {mode!r} not served by a duplex session")
        with self._lock:
            if self._active is not None:
                raise RuntimeError("the model already serves a session (one per GPU)")
            self._active = MiniCPMOSession(self, session_id, mode)
            return self._active

    def release(self, session: MiniCPMOSession) -> None:
        with self._lock:
            if self._active is session:
                self._active = None

    def chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """One chat turn with the model's chat(): the whole reply, then done."""
        if not turn.messages or turn.messages[-1].role != "user":
            raise ValueError("the last message must be the user's")
        model = self.model
        model.set_mode(mode_constant(model, "CHAT"))
        kwargs: dict[str, Any] = {
            "msgs": [self._chat_message(m) for m in turn.messages],
            "tokenizer": self.tokenizer,
            "generate_audio": turn.speech,
            "use_tts_template": turn.speech,
            "max_new_tokens": turn.max_new_tokens,
        }
        optional = {
            "temperature": turn.temperature,
            "top_p": turn.top_p,
            "max_slice_nums": turn.max_slice_nums,
            "use_image_id": turn.use_image_id,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if turn.enable_thinking:
            kwargs["enable_thinking"] = True
        if turn.omni_mode:
            kwargs["omni_input"] = True
        yield ChatChunk(prefilled=True)
        text, audio = _chat_output(model.chat(**kwargs))
        yield ChatChunk(text=text, audio=audio)
        ignored = ("length_penalty: chat() takes no length penalty",) if turn.length_penalty else ()
        yield ChatChunk(
            done=True,
            output_tokens=len(self.tokenizer.encode(text)) if text else 0,
            ignored=ignored,
        )

    @staticmethod
    def _chat_message(message: ChatMessage) -> dict[str, Any]:
        from PIL import Image

        content: list[Any] = []
        for part in message.parts:
            if isinstance(part, bytes):
                content.append(Image.open(io.BytesIO(part)).convert("RGB"))
            else:
                content.append(part)  # text, or 16 kHz float32 audio as the model takes it
        return {"role": message.role, "content": content}


def _chat_output(result: Any) -> tuple[str, np.ndarray]:
    """chat() returns the text, or text with audio (a tuple or a dict): normalise."""
    audio: Any = None
    if isinstance(result, dict):
        text, audio = result.get("text", ""), result.get("audio_waveform", result.get("audio"))
    elif isinstance(result, tuple):
        text, audio = result[0], result[1] if len(result) > 1 else None
    else:
        text = result
    wave_out = np.zeros(0, np.float32)
    if audio is not None:
        wave_out = np.asarray(audio, dtype=np.float32).reshape(-1)
    return str(text or ""), wave_out


__all__ = ["MiniCPMOEngine", "MiniCPMOSession", "check_model_dir", "check_runtime"]
