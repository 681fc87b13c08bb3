"""Turn-based chat on MiniCPM-o 4.5 through the model's streaming path (its chat(stream=True)
is broken): streaming_prefill once per message, then iterate streaming_generate.

MiniCPMOEngine.chat calls `stream_turn` with itself; this module knows the engine only as
a `ChatEngine` and never imports it."""

from __future__ import annotations

import inspect
import tempfile
import uuid
from collections.abc import Generator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omnifabric.worker.engine import ChatChunk, ChatMessage, ChatTurn
from omnifabric.worker.engines.minicpmo.vocoder import share_kept

#: Special tokens the text-only stream leaves in its text.
TERMINATORS = ("<|im_end|>", "<|endoftext|>", "<|tts_eos|>", "<|turn_eos|>", "<|tts_bos|>")


def _clean(text: str) -> str:
    for token in TERMINATORS:
        text = text.replace(token, "")
    return text


class ChatEngine(Protocol):
    """What a chat turn uses of the engine: worker.engines.minicpmo.engine.MiniCPMOEngine."""

    @property
    def model(self) -> Any: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def audio_on(self) -> bool: ...
    @property
    def default_voice(self) -> Path | None: ...
    def chat_content(self, message: ChatMessage) -> list[Any]: ...

    chat_voice_kept: Any
    """The default voice as the chat path prepared it (vocoder.Voice), kept for later turns."""


def prefill(
    model: Any,
    session_id: str,
    role: str,
    content: list[Any],
    *,
    speech: bool,
    omni_mode: bool = False,
    max_slice_nums: int | None = None,
    enable_thinking: bool = False,
) -> None:
    """One message into the conversation kept under `session_id` (streaming_prefill takes
    one message a call). A user's audio longer than one streaming chunk goes in whole where
    the code takes whole audio (`stream_input=False`: the demo's unified class, as the
    reference server prefills a half-duplex turn); the HF code only streams it, so there it
    goes in the model's own chunks (FIRST_CHUNK_MS, then CHUNK_MS; the message's other parts
    before the audio with the first chunk, after it with the last), the last one flagged."""
    common: dict[str, Any] = {
        "session_id": session_id,
        "omni_mode": omni_mode,
        "max_slice_nums": max_slice_nums,
        "use_tts_template": speech,
        "enable_thinking": enable_thinking,
    }
    audios = [i for i, part in enumerate(content) if isinstance(part, np.ndarray)]
    rate = int(getattr(model, "SAMPLE_RATE", 16000))
    first = rate * int(getattr(model, "FIRST_CHUNK_MS", 1035)) // 1000
    every = rate * int(getattr(model, "CHUNK_MS", 1000)) // 1000
    whole = "stream_input" in inspect.signature(model.streaming_prefill).parameters
    if whole:
        common["stream_input"] = False
    if whole or role == "system" or len(audios) != 1 or content[audios[0]].size <= first:
        msg = {"role": role, "content": content}
        model.streaming_prefill(msgs=[msg], is_last_chunk=True, **common)
        return
    at = audios[0]
    audio = content[at]
    cuts = [0, first, *range(first + every, audio.size, every), audio.size]
    pieces = [audio[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    for i, piece in enumerate(pieces):
        parts = [piece]
        if i == 0:
            parts = [*content[:at], *parts]
        if i == len(pieces) - 1:
            parts = [*parts, *content[at + 1 :]]
        msg = {"role": role, "content": parts}
        model.streaming_prefill(msgs=[msg], is_last_chunk=i == len(pieces) - 1, **common)


class Reply:
    """One answer of the model's streaming_generate on the conversation prefilled under
    `session_id`: text (and speech) pieces as they come, held to `max_new_tokens`. Pulled
    piece by piece (`next_piece`), so a chat turn streams it and a half-duplex call speaks
    one piece per unit. Raises what the model raises."""

    def __init__(
        self,
        engine: ChatEngine,
        session_id: str,
        speech: bool,
        max_new_tokens: int,
        *,
        enable_thinking: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        length_penalty: float | None = None,
    ) -> None:
        self.tokenizer = engine.tokenizer
        self.speech = speech
        self.max_new_tokens = max_new_tokens
        self.text = ""
        self.finished = False
        """The model ended the answer itself (text-only streams say so)."""
        self.cut = False
        """The answer reached max_new_tokens."""
        model = engine.model
        kwargs: dict[str, Any] = {
            "session_id": session_id,
            "generate_audio": speech,
            "max_new_tokens": max_new_tokens,
            "enable_thinking": enable_thinking,
            "use_tts_template": speech,
            "do_sample": temperature != 0,
        }
        if temperature is not None and temperature > 0:
            kwargs["temperature"] = temperature
        for key, value in (("top_p", top_p), ("top_k", top_k), ("length_penalty", length_penalty)):
            if value is not None:
                kwargs[key] = value
        if "tokenizer" in inspect.signature(model.streaming_generate).parameters:
            kwargs["tokenizer"] = self.tokenizer  # the HF code takes it; the demo's uses its own
        self._stream = model.streaming_generate(**kwargs)
        self._ended = False

    def next_piece(self) -> ChatChunk | None:
        """The answer's next piece with text or speech, None once it has ended."""
        while not self._ended:
            item = next(self._stream, None)
            if item is None:
                self.close()
                return None
            first, second = item
            wave = None
            if self.speech:
                wave = first.numpy() if hasattr(first, "numpy") else np.asarray(first)
                piece = _clean(str(second or ""))
            else:
                piece = _clean(str(first or ""))
                self.finished = self.finished or bool(second)
            # The model generates in chunks of several tokens: hold it to the limit.
            ids = self.tokenizer.encode(self.text + piece, add_special_tokens=False)
            if len(ids) > self.max_new_tokens:
                piece = self.tokenizer.decode(ids[: self.max_new_tokens])[len(self.text) :]
                self.cut = True
                self.close()
            self.text += piece
            if piece or wave is not None:
                audio = np.zeros(0, np.float32)
                if wave is not None:
                    audio = np.asarray(wave, np.float32).reshape(-1)
                return ChatChunk(text=piece, audio=audio)
        return None

    def output_tokens(self) -> int:
        return len(self.tokenizer.encode(self.text, add_special_tokens=False)) if self.text else 0

    def close(self) -> None:
        """Stop generating (idempotent)."""
        if not self._ended:
            self._ended = True
            self._stream.close()


def stream_turn(engine: ChatEngine, turn: ChatTurn) -> Generator[ChatChunk, None, None]:
    """Prefilled chunk, text/audio chunks, then done with the real counts. Raises what the
    model raises (the worker reports it as an error event)."""
    import torch

    model = engine.model
    session_id = f"chat-{uuid.uuid4().hex[:12]}"
    speech = bool(turn.speech) and engine.audio_on
    ignored: list[str] = []
    if turn.speech and not engine.audio_on:
        ignored.append("speech: this worker runs the model text-only (no vocoder)")
    if turn.length_penalty is not None:
        ignored.append("length_penalty: the chat path takes no length penalty")
    model.reset_session(reset_token2wav_cache=True)
    if speech:
        init_voice(engine, turn.voice)
    with torch.no_grad():
        for message in turn.messages:
            prefill(
                model,
                session_id,
                message.role,
                engine.chat_content(message),
                speech=speech,
                omni_mode=turn.omni_mode,
                max_slice_nums=turn.max_slice_nums,
                enable_thinking=turn.enable_thinking,
            )
        input_tokens = int(model._get_kv_cache_length())
        yield ChatChunk(prefilled=True, input_tokens=input_tokens)
        reply = Reply(
            engine,
            session_id,
            speech,
            turn.max_new_tokens,
            enable_thinking=turn.enable_thinking,
            temperature=turn.temperature,
            top_p=turn.top_p,
        )
        try:
            while (chunk := reply.next_piece()) is not None:
                yield chunk
        finally:
            reply.close()
    output_tokens = reply.output_tokens()
    yield ChatChunk(
        done=True,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cut=reply.cut
        or output_tokens >= turn.max_new_tokens
        or (not speech and not reply.finished),
        ignored=tuple(ignored),
    )


def init_voice(engine: ChatEngine, pcm: np.ndarray | None) -> None:
    """`model.init_token2wav_cache(pcm)`: the answer's voice for the model's chat path, the
    engine's default voice where `pcm` is none. The model code writes the voice to a
    temporary WAV for the vocoder and leaves it there (one file a chat turn or half-duplex
    call with speech, 127 KB for the default voice); the vocoder keeps the voice it prepared
    under that name and reads the file no more, so it is removed here. The caches the model
    keeps for the conversation's turns become the voice's shared copy (vocoder.share_kept),
    and the default voice is kept by the engine, so that a later turn in it is not prepared
    again (the speaker embedding, the speech tokens and the flow over the voice)."""
    default = pcm is None or not pcm.size
    if default:
        pcm = default_voice_pcm(engine)
        if pcm is None:
            return
    model = engine.model
    model.init_token2wav_cache(pcm)
    t2w = model.tts.audio_tokenizer
    written = Path(str(getattr(t2w, "_stream_prompt", "") or ""))
    temp = Path(tempfile.gettempdir())
    if written.parent == temp and written.name.startswith("tmp") and written.suffix == ".wav":
        written.unlink(missing_ok=True)
    share_kept(model, model.token2wav_cache)
    if default:
        engine.chat_voice_kept = getattr(t2w, "voice", None)


def default_voice_pcm(engine: ChatEngine) -> np.ndarray | None:
    """The engine's default voice as 16 kHz float32 samples (None when it has none)."""
    from omnifabric.worker.engines.minicpmo.voice import read_wav

    return read_wav(engine.default_voice) if engine.default_voice else None
