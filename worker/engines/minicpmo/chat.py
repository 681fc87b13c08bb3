"""Turn-based chat on MiniCPM-o 4.5 through the model's streaming path (its chat(stream=True)
is broken): streaming_prefill once per message, then iterate streaming_generate.

MiniCPMOEngine.chat calls `stream_turn` with itself; this module knows the engine only as
a `ChatEngine` and never imports it."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Generator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omnifabric.worker.engine import ChatChunk, ChatMessage, ChatTurn

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


def stream_turn(engine: ChatEngine, turn: ChatTurn) -> Generator[ChatChunk, None, None]:
    """Prefilled chunk, text/audio chunks, then done with the real counts. Raises what the
    model raises (the worker reports it as an error event)."""
    import torch

    model = engine.model
    tokenizer = engine.tokenizer
    session_id = f"chat-{uuid.uuid4().hex[:12]}"
    speech = bool(turn.speech) and engine.audio_on
    ignored: list[str] = []
    if turn.speech and not engine.audio_on:
        ignored.append("speech: this worker runs the model text-only (no vocoder)")
    if turn.length_penalty is not None:
        ignored.append("length_penalty: the chat path takes no length penalty")
    model.reset_session(reset_token2wav_cache=True)
    if speech:
        voice_pcm = turn.voice
        if voice_pcm is None or not voice_pcm.size:
            from omnifabric.worker.engines.minicpmo.voice import read_wav

            voice_pcm = read_wav(engine.default_voice) if engine.default_voice else None
        if voice_pcm is not None:
            model.init_token2wav_cache(voice_pcm)
    with torch.no_grad():
        for message in turn.messages:
            model.streaming_prefill(
                session_id=session_id,
                msgs=[{"role": message.role, "content": engine.chat_content(message)}],
                omni_mode=turn.omni_mode,
                max_slice_nums=turn.max_slice_nums,
                use_tts_template=speech,
                enable_thinking=turn.enable_thinking,
                is_last_chunk=True,
            )
        input_tokens = int(model._get_kv_cache_length())
        yield ChatChunk(prefilled=True, input_tokens=input_tokens)
        kwargs: dict[str, Any] = {
            "session_id": session_id,
            "generate_audio": speech,
            "max_new_tokens": turn.max_new_tokens,
            "enable_thinking": turn.enable_thinking,
            "use_tts_template": speech,
            "do_sample": turn.temperature != 0,
        }
        if turn.temperature is not None and turn.temperature > 0:
            kwargs["temperature"] = turn.temperature
        if turn.top_p is not None:
            kwargs["top_p"] = turn.top_p
        if "tokenizer" in inspect.signature(model.streaming_generate).parameters:
            kwargs["tokenizer"] = tokenizer  # the HF code takes it; the demo's uses its own
        text = ""
        finished = cut = False
        stream = model.streaming_generate(**kwargs)
        try:
            for first, second in stream:
                wave = None
                if speech:
                    wave = first.numpy() if hasattr(first, "numpy") else np.asarray(first)
                    piece = _clean(str(second or ""))
                else:
                    piece = _clean(str(first or ""))
                    finished = finished or bool(second)
                # The model generates in chunks of several tokens: hold it to the limit.
                ids = tokenizer.encode(text + piece, add_special_tokens=False)
                if len(ids) > turn.max_new_tokens:
                    piece = tokenizer.decode(ids[: turn.max_new_tokens])[len(text) :]
                    cut = True
                text += piece
                if piece or wave is not None:
                    audio = np.zeros(0, np.float32)
                    if wave is not None:
                        audio = np.asarray(wave, np.float32).reshape(-1)
                    yield ChatChunk(text=piece, audio=audio)
                if cut:
                    break
        finally:
            stream.close()
    output_tokens = len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
    yield ChatChunk(
        done=True,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cut=cut or output_tokens >= turn.max_new_tokens or (not speech and not finished),
        ignored=tuple(ignored),
    )
