"""The minicpmo engine's parts that need no model code: directory and runtime checks,
layout detection (from code shaped like each public layout), re-chunking, the per-session
state swap. The engine against the real public code: tests/worker/minicpmo (opt-in)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.engine import DuplexSettings
from omnifabric.worker.engines.minicpmo import (
    MiniCPMOEngine,
    check_model_dir,
    check_runtime,
    layouts,
)
from omnifabric.worker.engines.minicpmo.state import SharedState
from omnifabric.worker.engines.registry import load_engine
from omnifabric.worker.errors import EngineUnavailable
from omnifabric.worker.rechunk import Rechunker
from omnifabric.worker.units import UnitInput
from tests.conftest import ROOT, scaled


def skeleton(classes: dict[str, list[str]]) -> str:
    """Python source with these classes and method names (bodies `...`): only the shapes
    layout detection reads, nothing of the model code."""
    lines = []
    for name, methods in classes.items():
        lines.append(f"class {name}:")
        lines += [f"    def {method}(self, *args, **kwargs): ..." for method in methods]
    return "\n".join(lines) + "\n"


DUPLEX_METHODS = ["prepare", "streaming_prefill", "streaming_generate"]
# The HF checkpoint's code: MiniCPMO.as_duplex, a duplex class built from the model.
STOCK_HF = skeleton(
    {"MiniCPMO": ["as_duplex"], "MiniCPMODuplex": ["from_existing_model", *DUPLEX_METHODS]}
)
# The demo repositories' modeling_minicpmo.py: a duplex class that loads the model itself.
DEMO_STOCK = skeleton({"MiniCPMO": ["chat"], "MiniCPMODuplex": ["__init__", *DUPLEX_METHODS]})
# The demo repositories' modeling_minicpmo_unified.py.
DEMO_UNIFIED = skeleton({"MiniCPMO": ["init_unified"], "DuplexCapability": ["prepare"]})
# A model class with no duplex API at all.
CHAT_ONLY = skeleton({"MiniCPMO": ["chat", "init_tts"]})


def checkpoint(tmp_path: Path, modeling: str = DEMO_STOCK, unified: str | None = None) -> Path:
    (tmp_path / "config.json").write_text(
        '{"auto_map": {"AutoModel": "modeling_minicpmo.MiniCPMO"}}'
    )
    (tmp_path / "model.safetensors").write_text("")
    (tmp_path / "modeling_minicpmo.py").write_text(modeling)
    if unified is not None:
        (tmp_path / "modeling_minicpmo_unified.py").write_text(unified)
    return tmp_path


@pytest.mark.parametrize(
    "modeling, unified, found",
    [
        (STOCK_HF, None, [layouts.AS_DUPLEX]),
        (DEMO_STOCK, None, [layouts.DUPLEX]),
        (DEMO_STOCK, DEMO_UNIFIED, [layouts.UNIFIED, layouts.DUPLEX]),
        (CHAT_ONLY, None, []),
    ],
)
def test_detects_the_layouts_a_directory_offers(tmp_path, modeling, unified, found):
    assert layouts.detect(checkpoint(tmp_path, modeling, unified)) == found


def test_a_directory_offering_no_duplex_api_fails_with_what_is_missing(tmp_path):
    """The failure the stock checkpoint met before: a model class without init_unified or
    duplex methods is EngineUnavailable naming the APIs looked for, at load."""
    root = checkpoint(tmp_path, CHAT_ONLY)
    with pytest.raises(EngineUnavailable, match="as_duplex or MiniCPMODuplex.*init_unified"):
        layouts.choose(root)
    engine = MiniCPMOEngine(str(root), device="cpu")
    with pytest.raises(EngineUnavailable, match="offers no MiniCPM-o 4.5 duplex API"):
        engine.load()


def test_a_wanted_layout_must_be_offered(tmp_path):
    root = checkpoint(tmp_path, DEMO_STOCK)
    assert layouts.choose(root, "duplex") == layouts.DUPLEX
    with pytest.raises(EngineUnavailable, match="does not offer modeling_minicpmo_unified"):
        layouts.choose(root, "unified")
    with pytest.raises(EngineUnavailable, match="unknown MiniCPM-o API"):
        layouts.choose(root, "fast")


@pytest.mark.parametrize(
    "drop, message",
    [
        ("config.json", "no config.json"),
        ("model.safetensors", r"no \*\.safetensors"),
        ("modeling_minicpmo.py", "no modeling_minicpmo.py"),
    ],
)
def test_startup_names_the_missing_file(tmp_path, drop, message):
    root = checkpoint(tmp_path)
    (root / drop).unlink()
    with pytest.raises(EngineUnavailable, match=message):
        check_model_dir(root)


def test_startup_errors(tmp_path):
    with pytest.raises(EngineUnavailable, match="--model-dir"):
        check_model_dir(None)
    with pytest.raises(EngineUnavailable, match="not a directory"):
        check_model_dir(tmp_path / "nowhere")
    with pytest.raises(EngineUnavailable, match="transformers 4.51.x, found 5.23.0"):
        check_runtime("cuda", transformers_version="5.23.0")
    with pytest.raises(EngineUnavailable, match="runs on cuda or cpu"):
        check_runtime("mps", transformers_version="4.51.3")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_missing_is_named_before_any_weights_are_read(tmp_path, monkeypatch):
    from omnifabric.worker.engines.minicpmo import engine as engine_module

    monkeypatch.setattr(engine_module, "CODE_REQUIREMENTS", ("numpy",))
    with pytest.raises(EngineUnavailable, match="needs CUDA"):
        check_runtime("cuda:0")
    config = WorkerConfig(engine="minicpmo", model_path=str(checkpoint(tmp_path)))
    with pytest.raises(EngineUnavailable, match="needs CUDA"):
        load_engine("minicpmo", config)


def test_missing_model_code_packages_are_named(monkeypatch):
    from omnifabric.worker.engines.minicpmo import engine as engine_module

    monkeypatch.setattr(engine_module, "CODE_REQUIREMENTS", ("numpy", "no_such_package_x"))
    with pytest.raises(
        EngineUnavailable, match=r"needs no_such_package_x: pip install '\.\[minicpmo\]'"
    ):
        check_runtime("cpu")


def test_worker_process_reports_the_startup_error(tmp_path):
    """`omnifabric worker --engine minicpmo` fails early and says why (exit code != 0)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnifabric.worker",
            "--engine",
            "minicpmo",
            "--model-dir",
            str(tmp_path / "missing"),
            "--port",
            "0",
            "--metrics-port",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert run.returncode != 0
    assert "is not a directory" in run.stdout + run.stderr


# ---- re-chunking -------------------------------------------------------------------


def unit(seq: int, samples: int, **kw) -> UnitInput:
    return UnitInput(seq, np.arange(samples, dtype=np.float32) + 1000 * seq, **kw)


@pytest.mark.parametrize("seconds", [0.25, 0.5, 1.0, 1.5, 3.0, 4.0])
def test_rechunker_makes_exact_units_and_loses_nothing(seconds):
    chunker = Rechunker(16560, 16000)
    samples = int(seconds * 16000)
    made, fed = [], []
    for seq in range(1, 13):
        u = unit(seq, samples)
        fed.append(u.pcm)
        made += chunker.push(u)
    assert made, "no unit made"
    assert made[0].pcm.size == 16560 and all(m.pcm.size == 16000 for m in made[1:])
    assert not made[0].pcm[:560].any()  # the first unit is padded at its start
    joined = np.concatenate([m.pcm for m in made])[560:]
    total = np.concatenate(fed)
    assert np.array_equal(joined, total[: joined.size])  # in order, nothing lost
    assert joined.size + chunker.buffered_samples == total.size
    assert len(made) == int(12 * seconds)


def test_rechunker_carries_frames_and_force_listen_to_the_next_unit():
    chunker = Rechunker(16560, 16000)
    assert chunker.push(unit(1, 8000, frames=[b"a"], force_listen=True, max_slice_nums=2)) == []
    first = chunker.push(unit(2, 8000))
    assert [m.seq for m in first] == [2]
    assert first[0].frames == [b"a"] and first[0].force_listen and first[0].max_slice_nums == 2
    later = chunker.push(unit(3, 32000))
    assert [m.seq for m in later] == [3, 3]
    assert later[0].frames == [] and not later[0].force_listen and later[0].max_slice_nums == 0
    with pytest.raises(ValueError):
        Rechunker(100, 200)


# ---- the per-session state on the shared model ---------------------------------------


def test_shared_state_moves_each_sessions_values_on_and_off():
    vocoder = types.SimpleNamespace(
        stream_cache=None, hift_cache_dict=None, _stream_prompt=None, cache=None
    )
    model = types.SimpleNamespace(
        audio_past_key_values=None,
        audio_chunk_idx=0,
        processor=types.SimpleNamespace(_streaming_mel_processor=None),
        tts=types.SimpleNamespace(audio_tokenizer=vocoder),
    )
    state = SharedState(model)
    a, b = state.fresh(), state.fresh()
    state.load(a)
    model.audio_past_key_values, vocoder.stream_cache = "A-audio", "A-voc"
    model.processor._streaming_mel_processor = "A-mel"
    a = state.save()
    state.load(b)
    assert model.audio_past_key_values is None and vocoder.stream_cache is None
    assert model.processor._streaming_mel_processor is None
    model.audio_past_key_values = "B-audio"
    b = state.save()
    state.load(a)
    assert (model.audio_past_key_values, vocoder.stream_cache) == ("A-audio", "A-voc")
    assert model.processor._streaming_mel_processor == "A-mel"
    state.clear()
    assert model.audio_past_key_values is None and vocoder.cache is None
    assert b[":audio_past_key_values"] == "B-audio"


# ---- the default voice ---------------------------------------------------------------


def test_default_voice_sources(tmp_path, monkeypatch):
    from omnifabric.worker.engines.minicpmo import voice

    clip = voice.write_wav(np.zeros(1600, np.float32), tmp_path / "mine.wav")
    assert voice.resolve(clip, None) == (Path(clip), "configured")
    with pytest.raises(RuntimeError, match="does not exist"):
        voice.resolve(str(tmp_path / "nope.wav"), None)
    model = tmp_path / "model"
    (model / "assets" / "token2wav").mkdir(parents=True)
    voice.write_wav(np.zeros(1600, np.float32), model / "assets" / "token2wav" / "x.wav")
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    path, source = voice.resolve(None, model)  # the vocoder's own files are not voices
    assert source == "project" and path.parent == tmp_path / "cache"
    speech = voice.read_wav(path)
    assert speech.size > 16000 and np.abs(speech).max() > 0.05  # spoken, not silence
    voice.write_wav(np.zeros(1600, np.float32), model / "assets" / "sys_ref_audio.wav")
    assert voice.resolve(None, model) == (model / "assets" / "sys_ref_audio.wav", "model")


class VoiceHandle(layouts.Handle):
    """Records what prepare and generate are given (the real code: tests/worker/minicpmo)."""

    def __init__(self):
        super().__init__(types.SimpleNamespace(generate_audio=True, current_turn_ended=True))
        self.prepared = self.args = None

    def reset(self):
        pass

    def prepare(self, system_prompt, ref_audio, voice):
        self.prepared = (system_prompt, voice)

    def generate(self, args, force_listen):
        self.args = args
        return {"is_listen": True}

    def kv_length(self):
        return 7


def test_sessions_without_a_voice_speak_in_the_default_one(tmp_path):
    engine = MiniCPMOEngine(str(tmp_path), device="cpu")
    engine.audio_on, engine.default_voice = True, tmp_path / "default.wav"
    engine.state = SharedState(types.SimpleNamespace())
    handle = VoiceHandle()
    engine._free = [handle]
    session = engine.open_session("s", "audio")
    assert session.prepare("", None, None, DuplexSettings()) == 7
    assert handle.prepared == ("You are a helpful assistant.", str(tmp_path / "default.wav"))
    session.generate(False)
    assert handle.args["prompt_wav_path"] == str(tmp_path / "default.wav")
    session.close()
    session = engine.open_session("s2", "audio")
    session.prepare("Hi.", None, np.full(8000, 0.1, np.float32), DuplexSettings())
    own = handle.prepared[1]
    assert own != str(tmp_path / "default.wav") and Path(own).is_file()
    session.close()
    assert not Path(own).exists()  # the session's voice file goes with it
    session = engine.open_session("s3", "audio")
    session.prepare("Hi.", None, None, DuplexSettings(tts_enabled=False))
    assert handle.prepared[1] is None and handle.duplex.generate_audio is False
    session.close()


# ---- context windows: the model's own sliding window (the real code: tests/worker/minicpmo)


@dataclasses.dataclass
class DuplexWindowConfig:
    """Shaped like the public code's (utils.DuplexWindowConfig)."""

    sliding_window_mode: str = "off"
    basic_window_high_tokens: int = 8000
    basic_window_low_tokens: int = 6000
    context_previous_max_tokens: int = 500
    context_max_units: int = 24
    verify_mode: bool = False


class WindowDecoder:
    """A decoder with the public code's window API (set_window_config, set_window_enabled)."""

    def __init__(self):
        self._window_config = DuplexWindowConfig()
        self._window_enabled = True

    def set_window_config(self, config):
        self._window_config = config

    def set_window_enabled(self, enabled):
        self._window_enabled = enabled

    def reset(self):
        """The KV cache goes; the window stays (as the public decoder's reset)."""


class WindowHandle(VoiceHandle):
    """The layouts' own reset over a duplex with the public code's reset methods."""

    reset = layouts.Handle.reset

    def __init__(self, decoder):
        super().__init__()
        d = self.duplex
        d.decoder = decoder
        for name in ("_reset_streaming_state", "clear_break_event", "clear_session_stop"):
            setattr(d, name, lambda: None)
        self.window_at_prepare = None

    def prepare(self, system_prompt, ref_audio, voice):
        super().prepare(system_prompt, ref_audio, voice)
        self.window_at_prepare = self.window_mode


def window_settings(mode: str) -> DuplexSettings:
    return DuplexSettings(
        context_window=mode,
        window_high_tokens=900,
        window_low_tokens=700,
        window_units=12,
        window_previous_tokens=80,
    )


def test_a_session_s_window_is_set_on_its_decoder_before_its_prompt(tmp_path):
    engine = MiniCPMOEngine(str(tmp_path), device="cpu")
    engine.state = SharedState(types.SimpleNamespace())
    decoder = WindowDecoder()
    handle = WindowHandle(decoder)
    engine._free = [handle]
    for mode in ("basic", "context"):
        session = engine.open_session("s", "audio")
        session.prepare("Hi.", None, None, window_settings(mode))
        assert session.notes == ()
        assert handle.window_at_prepare == mode  # prepare saw it (context mode needs it)
        assert decoder._window_config == DuplexWindowConfig(mode, 900, 700, 80, 12)
        assert decoder._window_enabled is True
        session.close()
        # A closed session's window does not stay on the handle.
        assert handle.window_mode == "off" and decoder._window_enabled is False
    session = engine.open_session("s", "audio")
    session.prepare("Hi.", None, None, DuplexSettings())
    assert handle.window_at_prepare == "off" and session.notes == ()
    assert decoder._window_config.sliding_window_mode == "off"
    session.close()


class NoWindowDecoder:
    """A layout whose decoder has no window."""

    def reset(self):
        pass


def test_a_layout_without_a_window_says_so_and_leaves_it_off(tmp_path):
    engine = MiniCPMOEngine(str(tmp_path), device="cpu")
    engine.state = SharedState(types.SimpleNamespace())
    engine._free = [WindowHandle(NoWindowDecoder())]
    session = engine.open_session("s", "audio")
    session.prepare("Hi.", None, None, window_settings("basic"))
    assert session.notes == (
        "context_window: not available in this model code layout; the session closes "
        "with context_full",
    )
    session.close()
    session = engine.open_session("s", "audio")
    session.prepare("Hi.", None, None, DuplexSettings())
    assert session.notes == ()
    session.close()


def test_cudnn_attention_is_turned_off_once_and_said(caplog):
    """On CUDA the engine takes cuDNN out of torch's attention (a graph per shape: a duplex
    step's shapes change on every call); a second load changes nothing and logs nothing."""
    import torch

    from omnifabric.worker.engines.minicpmo.engine import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with caplog.at_level(logging.INFO, "omnifabric.worker.minicpmo"):
            avoid_cudnn_attention(torch)
            avoid_cudnn_attention(torch)
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        assert (
            torch.backends.cuda.flash_sdp_enabled()
            and torch.backends.cuda.mem_efficient_sdp_enabled()
        )
        assert [r.getMessage() for r in caplog.records].count(
            "minicpmo: cuDNN attention off (a graph per shape; duplex shapes change per call)"
        ) == 1
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_cost_estimate_is_the_warm_up_unit_not_the_one_time_work(tmp_path, monkeypatch):
    """A session's estimate before any unit is measured is what the warm-up's unit took,
    not the whole warm-up (the vocoder's first calls and the graph captures, once a worker:
    tens of seconds that would read as a session costing tens of engine seconds a second);
    a chat turn keeps Engine's."""
    from omnifabric.worker.engine import Engine
    from omnifabric.worker.engines.minicpmo import engine as engine_module
    from omnifabric.worker.headroom import CHAT_COST

    engine = MiniCPMOEngine(str(tmp_path), device="cpu")
    assert engine.cost_estimate("audio", 30.0) == 30.0  # not warmed: Engine's default
    clock = iter([100.0, 100.4, 100.5, 125.0])
    monkeypatch.setattr(
        engine_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock))
    )
    monkeypatch.setattr(Engine, "warmup", lambda self: "unit")
    captured = []

    class Stepper:
        def capture_graphs(self):
            captured.append(True)
            return {}

    engine.batched = Stepper()  # type: ignore[assignment]
    assert engine.warmup() == "unit"
    assert captured == [True]
    assert engine.warm_unit_s == pytest.approx(0.4)
    assert engine.cost_estimate("audio", 30.0) == pytest.approx(0.4)
    assert engine.cost_estimate("video", 30.0) == pytest.approx(0.4)
    assert engine.cost_estimate("chat", 30.0) == CHAT_COST


def test_the_batched_vocoder_is_kept_per_setting(tmp_path, monkeypatch):
    """A switch of `--cuda-graphs` and back (gpu_sessions' modes) finds the batched vocoder
    it left, with the buckets and graphs its warm-up made, not a new one."""
    from omnifabric.worker.engines.minicpmo import vocoder_batch

    made = []

    class Vocoder:
        def __init__(self, tok, static, graphs):
            self.flow = types.SimpleNamespace(static=static)
            made.append(self)

    monkeypatch.setattr(vocoder_batch, "BatchedVocoder", Vocoder)
    engine = MiniCPMOEngine(str(tmp_path), device="cpu", cuda_graphs="on")
    engine.model = types.SimpleNamespace(tts=types.SimpleNamespace(audio_tokenizer=object()))
    static = engine.batched_vocoder()
    assert static.flow.static
    engine.cuda_graphs = "off"
    ragged = engine.batched_vocoder()
    assert not ragged.flow.static
    engine.cuda_graphs = "on"
    assert engine.batched_vocoder() is static and engine.batched_vocoder() is static
    assert made == [static, ragged]


@pytest.mark.parametrize(
    "device, dtype, setting, tf32",
    [
        ("cuda", None, "auto", True),  # bfloat16 weights: the vocoder's products in TF32
        ("cuda:1", "bfloat16", "auto", True),
        ("cuda", "float32", "auto", False),  # float32 asked for: float32 throughout
        ("cpu", None, "auto", False),
        ("cuda", None, "off", False),
        ("cuda", "float32", "on", True),
    ],
)
def test_the_vocoders_tf32_follows_the_setting_and_the_weights(device, dtype, setting, tf32):
    engine = MiniCPMOEngine("/nowhere", device=device, dtype=dtype, vocoder_tf32=setting)
    assert engine.vocoder_in_tf32 is tf32


def test_the_vocoders_tf32_setting_reaches_the_engine_and_is_checked():
    config = WorkerConfig.from_env({"OMNI_WORKER_VOCODER_TF32": "off"})
    assert MiniCPMOEngine.from_config(config).vocoder_tf32 == "off"
    assert MiniCPMOEngine.from_config(WorkerConfig.from_env({})).vocoder_tf32 == "auto"
    with pytest.raises(ValueError, match="vocoder_tf32 is auto, on or off, not 'yes'"):
        MiniCPMOEngine("/nowhere", vocoder_tf32="yes")
    with pytest.raises(ValueError, match="cuda_graphs is auto, on or off, not 'ON'"):
        MiniCPMOEngine("/nowhere", cuda_graphs="ON")


def test_the_tts_slot_setting_reaches_the_engine_and_is_checked():
    config = WorkerConfig.from_env({"OMNI_WORKER_TTS_SLOT_TOKENS": "2048"})
    assert MiniCPMOEngine.from_config(config).tts_slot_tokens == 2048
    assert MiniCPMOEngine.from_config(WorkerConfig.from_env({})).tts_slot_tokens is None
    with pytest.raises(ValueError, match="OMNI_WORKER_TTS_SLOT_TOKENS"):
        WorkerConfig.from_env({"OMNI_WORKER_TTS_SLOT_TOKENS": "100"})
    with pytest.raises(ValueError, match="tts_slot_tokens is 1 or more, not 0"):
        MiniCPMOEngine("/nowhere", tts_slot_tokens=0)


def test_the_slots_spare_follows_the_setting():
    from omnifabric.worker.engines.minicpmo.engine import slot_tokens

    basic = WorkerConfig.from_env(
        {}, context_window="basic", window_high_tokens=4096, window_low_tokens=3000
    )
    assert slot_tokens(basic) == 4096
    assert MiniCPMOEngine.from_config(basic).kv_slot_tokens == 4096 + 1024
    spare = basic.with_overrides(slot_spare_tokens=128)
    assert MiniCPMOEngine.from_config(spare).kv_slot_tokens == 4096 + 128
    env = WorkerConfig.from_env({"OMNI_WORKER_SLOT_SPARE_TOKENS": "256"})
    assert MiniCPMOEngine.from_config(env).kv_slot_tokens == 8192 + 256
    with pytest.raises(ValueError, match="OMNI_WORKER_SLOT_SPARE_TOKENS"):
        WorkerConfig.from_env({"OMNI_WORKER_SLOT_SPARE_TOKENS": "8"})
    with pytest.raises(ValueError, match="slot_spare_tokens is 1 or more, not 0"):
        MiniCPMOEngine("/nowhere", slot_spare_tokens=0)
