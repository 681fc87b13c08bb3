"""The MiniCPM-o engine without the weights: the startup checks, and the exact calls it
makes on the model, driven through the worker's own unit loop (DuplexSession) with a
recording double of the model object. Behaviour is covered by the reference engine,
which goes through the same loop."""

from __future__ import annotations

import asyncio
import io
import sys
import types
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import scaled
from worker.config import WorkerConfig
from worker.engine import ChatMessage, ChatTurn, DuplexSettings, load_engine
from worker.engines import minicpmo
from worker.engines.minicpmo import MiniCPMOEngine, check_model_dir, check_runtime
from worker.errors import EngineUnavailable
from worker.session import (
    CloseReason,
    DuplexSession,
    SessionEnd,
    SessionLimits,
    SessionSpec,
    UnitInput,
)

SILENCE = np.zeros(16000, np.float32)

# A module standing for the checkpoint's own code: its mode enum is what set_mode takes.
fake_module = types.ModuleType("modeling_minicpmo_fake")
sys.modules[fake_module.__name__] = fake_module


class ProcessorMode(__import__("enum").Enum):
    CHAT = "chat"
    STREAMING = "streaming"
    DUPLEX = "duplex"


fake_module.ProcessorMode = ProcessorMode


class Decoder:
    def __init__(self) -> None:
        self.length = 0

    def get_cache_length(self) -> int:
        return self.length


class RecordingModel:
    """Records every call. Keyword-only parameters without defaults: a call that leaves
    one out (or misnames one) fails, as the real duplex_generate does with its None
    defaults. Speaks on the 5th and 6th unit, ending the turn on the 6th."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.duplex = types.SimpleNamespace(
            decoder=Decoder(), max_new_speak_tokens_per_chunk=20, force_listen_count=3
        )
        self.finalized = True
        self.generated = 0

    def set_mode(self, mode) -> None:
        self.calls.append(("set_mode", {"mode": mode}))
        self.duplex.decoder.length = 0

    def duplex_prepare(
        self, *, prefix_system_prompt, suffix_system_prompt, ref_audio, prompt_wav_path
    ):
        self.calls.append(
            (
                "duplex_prepare",
                {
                    "prefix_system_prompt": prefix_system_prompt,
                    "suffix_system_prompt": suffix_system_prompt,
                    "ref_audio": None if ref_audio is None else ref_audio.shape,
                    "prompt_wav_path": prompt_wav_path,
                    "voice_rate": _wav_rate(prompt_wav_path),
                },
            )
        )
        self.duplex.decoder.length = 40
        return prefix_system_prompt + suffix_system_prompt

    def duplex_prefill(self, *, audio_waveform, frame_list, max_slice_nums):
        if not self.finalized:
            raise RuntimeError("previous unit not finalized")
        self.calls.append(
            (
                "duplex_prefill",
                {
                    "samples": audio_waveform.size,
                    "dtype": str(audio_waveform.dtype),
                    "frames": [type(f).__name__ for f in frame_list],
                    "max_slice_nums": max_slice_nums,
                },
            )
        )
        self.duplex.decoder.length += 11
        return {"success": True, "reason": "", "cost_audio": 0.01, "cost_vision": 0.0}

    def duplex_generate(
        self,
        *,
        decode_mode,
        temperature,
        top_k,
        top_p,
        listen_prob_scale,
        listen_top_k,
        text_repetition_penalty,
        text_repetition_window_size,
        length_penalty,
        force_listen_override,
    ):
        self.calls.append(
            (
                "duplex_generate",
                dict(
                    decode_mode=decode_mode,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    listen_prob_scale=listen_prob_scale,
                    listen_top_k=listen_top_k,
                    text_repetition_penalty=text_repetition_penalty,
                    text_repetition_window_size=text_repetition_window_size,
                    length_penalty=length_penalty,
                    force_listen_override=force_listen_override,
                ),
            )
        )
        self.finalized = False
        self.generated += 1
        speak = self.generated in (5, 6) and not force_listen_override
        self.duplex.decoder.length += 20 if speak else 2
        return {
            "is_listen": not speak,
            "text": "Hello" if speak else "",
            "audio_waveform": np.full(24000, 0.1 if speak else 0.0, np.float32),
            "end_of_turn": self.generated == 6 and speak,
            "current_time": self.generated,
            "cost_llm": 0.2,
            "cost_tts_prep": 0.01,
            "cost_tts": 0.05,
            "cost_token2wav": 0.03,
            "cost_all": 0.3,
            "n_tokens": 5 if speak else 0,
            "n_tts_tokens": 25 if speak else 0,
        }

    def duplex_finalize(self) -> None:
        self.calls.append(("duplex_finalize", {}))
        self.finalized = True

    def duplex_set_break(self) -> None:
        self.calls.append(("duplex_set_break", {}))

    def duplex_stop(self) -> None:
        self.calls.append(("duplex_stop", {}))

    def duplex_cleanup(self) -> None:
        self.calls.append(("duplex_cleanup", {}))

    def chat(
        self, *, msgs, tokenizer, generate_audio, use_tts_template, max_new_tokens, **optional
    ):
        self.calls.append(
            (
                "chat",
                {
                    "roles": [m["role"] for m in msgs],
                    "content_types": [[type(c).__name__ for c in m["content"]] for m in msgs],
                    "generate_audio": generate_audio,
                    "use_tts_template": use_tts_template,
                    "max_new_tokens": max_new_tokens,
                    **optional,
                },
            )
        )
        return ("Paris.", np.full(12000, 0.1, np.float32)) if generate_audio else "Paris."


RecordingModel.__module__ = fake_module.__name__


def _wav_rate(path):
    if path is None:
        return None
    with wave.open(path) as w:
        return w.getframerate()


class Tokenizer:
    def encode(self, text):
        return text.split()


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (9, 9, 9)).save(buf, "JPEG")
    return buf.getvalue()


async def drive(engine, spec, units, force_at=frozenset(), frames=()):
    """Run units through the worker's DuplexSession (the one adapter path)."""
    executor = ThreadPoolExecutor(1)
    session = DuplexSession(spec, engine, executor, SessionLimits(60, 8192))
    await session.open()
    runner = asyncio.ensure_future(session.run())
    events = []
    for seq in range(1, units + 1):
        session.submit(
            UnitInput(
                seq=seq,
                pcm=SILENCE,
                frames=list(frames),
                force_listen=seq in force_at,
                max_slice_nums=0,
            )
        )
        while len(events) < seq:
            events.append(await asyncio.wait_for(session._events.get(), scaled(5)))
    session.close(CloseReason.USER_STOP)
    async for event in session.events():
        events.append(event)
    await asyncio.wait_for(runner, scaled(5))
    executor.shutdown()
    return events


async def test_duplex_call_shapes_through_the_unit_loop():
    model = RecordingModel()
    engine = MiniCPMOEngine(model=model, tokenizer=Tokenizer())
    settings = DuplexSettings(
        temperature=0.5,
        top_k=30,
        length_penalty=1.3,
        max_new_speak_tokens_per_chunk=12,
        max_slice_nums=2,
    )
    spec = SessionSpec(
        session_id="s1",
        lease_id="l1",
        mode="video",
        system_prompt="Be brief.",
        ref_audio=np.zeros(32000, np.float32),
        tts_ref_audio=None,
        settings=settings,
    )
    events = await drive(engine, spec, 7, frames=[_jpeg()])
    names = [name for name, _ in model.calls]
    # prepare: a mode switch (clears KV) then duplex_prepare with the reference server's
    # prompt framing; the LLM reference audio doubles as the TTS voice (a 16 kHz WAV).
    assert names[:2] == ["set_mode", "duplex_prepare"]
    assert model.calls[0][1]["mode"] is ProcessorMode.DUPLEX
    prep = model.calls[1][1]
    assert prep["prefix_system_prompt"] == "<|im_start|>system\nBe brief.\n<|audio_start|>"
    assert prep["suffix_system_prompt"] == "<|audio_end|><|im_end|>"
    assert prep["ref_audio"] == (32000,) and prep["voice_rate"] == 16000
    assert not Path(prep["prompt_wav_path"]).exists()  # deleted at close
    # Per unit: prefill -> generate -> finalize, finalize always before the next prefill.
    loop = names[2 : 2 + 3 * 7]
    assert loop == ["duplex_prefill", "duplex_generate", "duplex_finalize"] * 7
    prefills = [a for n, a in model.calls if n == "duplex_prefill"]
    assert prefills[0]["samples"] == 16560 and prefills[1]["samples"] == 16000  # 1.035 s first
    assert prefills[0]["dtype"] == "float32"
    assert prefills[0]["frames"] == ["Image"] and prefills[0]["max_slice_nums"] == 2
    gens = [a for n, a in model.calls if n == "duplex_generate"]
    assert gens[0] == dict(
        decode_mode="sampling",
        temperature=0.5,
        top_k=30,
        top_p=0.8,
        listen_prob_scale=1.0,
        listen_top_k=None,
        text_repetition_penalty=1.05,
        text_repetition_window_size=512,
        length_penalty=1.3,
        force_listen_override=True,
    )
    # Startup protection: the first 3 units are forced to listen, then the model decides.
    assert [g["force_listen_override"] for g in gens] == [True] * 3 + [False] * 4
    assert names[-2:] == ["duplex_stop", "duplex_cleanup"]
    assert model.duplex.max_new_speak_tokens_per_chunk == 12
    # Results: listening units carry no audio; speaking ones carry the model's speech,
    # its text, the KV length from the decoder, costs in ms and vision tokens in usage.
    results = [e for e in events if not isinstance(e, SessionEnd)]
    assert [r.result.is_listen for r in results] == [True] * 4 + [False, False, True]
    assert results[0].result.audio.size == 0 and results[4].result.audio.size == 24000
    assert results[5].result.end_of_turn and results[4].result.text == "Hello"
    # prompt 40, +11 per prefill, +2 per listening and +20 per speaking generate.
    assert results[4].result.kv_cache_length == 40 + 5 * 11 + 4 * 2 + 20
    assert results[4].timings.engine_costs_ms["llm"] == pytest.approx(200.0)
    assert results[-1].usage.input_vision_tokens == 7 * 2 * 64
    assert isinstance(events[-1], SessionEnd) and events[-1].reason is CloseReason.USER_STOP


async def test_force_listen_breaks_speech_and_tts_off_drops_audio():
    model = RecordingModel()
    engine = MiniCPMOEngine(model=model, tokenizer=Tokenizer())
    spec = SessionSpec(
        session_id="s2",
        lease_id="l2",
        mode="audio",
        tts_ref_audio=np.zeros(16000, np.float32),
        settings=DuplexSettings(tts_enabled=False, force_listen_count=0),
    )
    events = await drive(engine, spec, 6, force_at=frozenset({6}))
    names = [n for n, _ in model.calls]
    # Unit 5 spoke, so force_listen on unit 6 breaks the speech before generating.
    assert names.count("duplex_set_break") == 1
    assert names.index("duplex_set_break") < len(names) - 1 - names[::-1].index("duplex_generate")
    gens = [a["force_listen_override"] for n, a in model.calls if n == "duplex_generate"]
    assert gens == [False] * 5 + [True]
    spoken = [e for e in events if not isinstance(e, SessionEnd) and not e.result.is_listen]
    assert spoken and all(e.result.audio.size == 0 for e in spoken)
    assert model.duplex.force_listen_count == 0


def test_one_session_per_gpu():
    engine = MiniCPMOEngine(model=RecordingModel(), tokenizer=Tokenizer())
    first = engine.open_session("a", "audio")
    with pytest.raises(RuntimeError, match="one per GPU"):
        engine.open_session("b", "audio")
    first.close()
    engine.open_session("b", "audio").close()


def test_chat_call_shape():
    model = RecordingModel()
    engine = MiniCPMOEngine(model=model, tokenizer=Tokenizer())
    turn = ChatTurn(
        (
            ChatMessage("system", ("Be brief.",)),
            ChatMessage("user", ("Where?", _jpeg(), np.zeros(16000, np.float32))),
        ),
        max_new_tokens=64,
        speech=True,
        temperature=0.6,
        max_slice_nums=2,
        omni_mode=True,
    )
    chunks = list(engine.chat(turn))
    name, args = model.calls[-1]
    assert model.calls[0] == ("set_mode", {"mode": ProcessorMode.CHAT})
    assert name == "chat" and args["roles"] == ["system", "user"]
    assert args["content_types"] == [["str"], ["str", "Image", "ndarray"]]
    assert args["generate_audio"] is True and args["use_tts_template"] is True
    assert args["max_new_tokens"] == 64 and args["temperature"] == 0.6
    assert args["max_slice_nums"] == 2 and args["omni_input"] is True
    assert chunks[0].prefilled and chunks[1].text == "Paris." and chunks[1].audio.size == 12000
    assert chunks[-1].done and chunks[-1].output_tokens == 1


def _checkpoint(tmp_path: Path, drop: str | None = None) -> Path:
    files = {"config.json": "{}", "model-00001.safetensors": "", "modeling_minicpmo.py": ""}
    for name, text in files.items():
        if name != drop:
            (tmp_path / name).write_text(text)
    if drop != "token2wav":
        (tmp_path / "assets" / "token2wav").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize(
    "drop, message",
    [
        ("config.json", "no config.json"),
        ("model-00001.safetensors", r"no \*\.safetensors"),
        ("modeling_minicpmo.py", r"modeling_\*\.py"),
        ("token2wav", "assets/token2wav"),
    ],
)
def test_startup_names_the_missing_file(tmp_path, drop, message):
    with pytest.raises(EngineUnavailable, match=message):
        check_model_dir(_checkpoint(tmp_path, drop))


def test_startup_errors(tmp_path):
    with pytest.raises(EngineUnavailable, match="--model-path"):
        check_model_dir(None)
    with pytest.raises(EngineUnavailable, match="not a directory"):
        check_model_dir(tmp_path / "nowhere")
    assert check_model_dir(_checkpoint(tmp_path)) == tmp_path
    with pytest.raises(EngineUnavailable, match="transformers 4.51.x, found 5.23.0"):
        check_runtime("cuda", transformers_version="5.23.0")
    with pytest.raises(EngineUnavailable, match="runs on CUDA"):
        check_runtime("cpu", transformers_version="4.51.3")
    # This machine has no GPU: the real check says so, before any weights are read.
    with pytest.raises(EngineUnavailable, match="needs CUDA"):
        check_runtime("cuda:0")
    config = WorkerConfig(engine="minicpmo", model_path=str(tmp_path))
    with pytest.raises(EngineUnavailable, match="needs CUDA"):
        load_engine("minicpmo", config)
    with pytest.raises(EngineUnavailable, match="--slots 1"):
        MiniCPMOEngine.from_config(WorkerConfig(engine="minicpmo", slots=2))


def test_worker_process_reports_the_startup_error(tmp_path):
    """`omnifabric worker --engine minicpmo` fails early and says why (exit code != 0)."""
    import subprocess

    from tests.conftest import ROOT

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "--engine",
            "minicpmo",
            "--model-path",
            str(tmp_path / "missing"),
            "--port",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert run.returncode != 0
    assert "is not a directory" in run.stdout + run.stderr


def test_mode_constant_falls_back_to_a_name():
    assert minicpmo.mode_constant(object(), "DUPLEX") == "duplex"
