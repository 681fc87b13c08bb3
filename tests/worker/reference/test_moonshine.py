"""Moonshine base-en from moonshine-cpp's ORT files, run in torch; and Ears, which hears with
Whisper base and Moonshine together. Real weights, speech from espeak-ng."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from scipy.io import wavfile
from scipy.signal import resample_poly

from omnifabric.worker.engines.reference import linears, moonshine
from omnifabric.worker.engines.reference.asr import (
    Transcriber,
    model_installed,
    spread_threads,
    torch_threads,
)
from omnifabric.worker.engines.reference.hearing import Ears
from omnifabric.worker.engines.reference.linears import in_bf16, use_onednn, wants_bf16
from omnifabric.worker.engines.reference.moonshine import Moonshine, _loop_end, read_ort

pytestmark = pytest.mark.skipif(
    not moonshine.model_installed() or not model_installed("base"),
    reason="Moonshine (moonshine-cpp) or Whisper base weights not installed",
)
ESPEAK = "/usr/bin/espeak-ng"


@pytest.fixture(scope="module")
def ms() -> Moonshine:
    return Moonshine()


@pytest.fixture(scope="module")
def ears(ms) -> Ears:
    return Ears(Transcriber(model="base"), ms)


@pytest.fixture(scope="module")
def speak(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speech")

    def make(text: str, voice: str = "en-us", rate: int = 160) -> np.ndarray:
        path = folder / "say.wav"
        subprocess.run([ESPEAK, "-v", voice, "-s", str(rate), "-w", str(path), text], check=True)
        sr, pcm = wavfile.read(path)
        audio = resample_poly(pcm.astype(np.float32) / 32768.0, 320, 441).astype(np.float32)
        return np.concatenate([np.zeros(4000, np.float32), audio, np.zeros(4800, np.float32)])

    return make


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def test_every_parameter_comes_from_the_files(ms):
    params = dict(ms.model.named_parameters())
    assert 55e6 < sum(p.numel() for p in params.values()) < 65e6
    assert not any(p.is_meta for p in params.values())
    # The output projection is the token embedding (tied in the files' logits MatMul).
    assert torch.equal(ms.model.proj_out.weight, ms.model.model.decoder.embed_tokens.weight)
    # Dequantized weights are not what a random init gives: int8 steps show in each tensor.
    q = ms.model.model.decoder.layers[0].self_attn.q_proj.weight
    steps = torch.unique(q).numel()
    assert 100 < steps <= 256, steps


def test_transcribes_a_question(ms, speak):
    audio = speak("What time does the train leave for Boston?")
    text, logprob = ms.decode(ms.encode(audio))
    assert words(text) == words("What time does the train leave for Boston?"), text
    assert -1.0 < logprob <= 0


def test_scoring_agrees_with_decoding(ms, speak):
    enc = ms.encode(speak("Can you tell me the weather for tomorrow morning?"))
    text, mean = ms.decode(enc)
    total, n = ms.score(enc, text)
    assert total / n == pytest.approx(mean, abs=1e-3)
    # The tokenizer gives back the ids the model chose, and text the model finds unlikely
    # scores lower.
    assert ms.text(ms.ids(text)) == text
    wrong, _ = ms.score(enc, "Can you sell me the feather for tomorrow morning?")
    assert wrong < total - 5


def test_ids_fall_back_to_bytes(ms):
    ids = ms.ids("naïve ☃")
    assert ms.text(ids) == "naïve ☃"
    assert any(3 <= i < 259 for i in ids)  # the snowman has no piece of its own


def test_loop_guard():
    assert _loop_end([5, 6, 7, 6, 7, 6, 7]) == 3  # "x y z y z y z": keep "x y z"
    assert _loop_end([1, 2, 1, 2]) is None  # one repeat of two tokens is speech ("no no")
    assert _loop_end([9, 9, 9, 9, 9]) == 1


def test_a_file_that_is_not_the_model_is_refused(tmp_path):
    fake = tmp_path / "encoder_model.ort"
    fake.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not an ORT-format model"):
        read_ort(fake)
    folder = tmp_path / "swapped"
    folder.mkdir()
    source = moonshine.model_dir()
    # The decoder's file where the encoder's should be: its weights map to nothing there.
    shutil.copy(source / "decoder_model_merged.ort", folder / "encoder_model.ort")
    shutil.copy(source / "decoder_model_merged.ort", folder / "decoder_model_merged.ort")
    with pytest.raises(ValueError):
        moonshine.load_model(folder)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(moonshine, "PACKAGE", "no_such_moonshine_package")
    with pytest.raises(FileNotFoundError, match="pip install moonshine-cpp"):
        moonshine.model_dir()
    assert not moonshine.model_installed()


def test_onednn_layers_give_the_stock_result():
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        stock = layer(x)
    model = torch.nn.Sequential(layer)
    if use_onednn(model) == 0:
        pytest.skip("this torch build has no oneDNN linear kernel")
    with torch.inference_mode():
        assert torch.allclose(layer(x), stock, atol=1e-5)


def test_bf16_layers_are_near_the_stock_result_where_the_cpu_computes_them():
    if not linears.native_bf16():
        pytest.skip("this CPU has no native bfloat16 (AVX512-BF16 or AMX)")
    layer = torch.nn.Linear(384, 256)
    x = torch.randn(3, 7, 384, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        stock = layer(x)
    model = torch.nn.Sequential(layer)
    assert use_onednn(model, bf16=True) == 1
    assert in_bf16(model)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.float32 and out.shape == stock.shape
    scale = float(stock.abs().max())
    assert float((out - stock).abs().max()) <= linears.BF16_TOLERANCE * scale
    assert not torch.equal(out, stock)  # it did compute in bfloat16


def test_bf16_asked_where_the_cpu_lacks_it_stays_fp32(monkeypatch):
    monkeypatch.setattr(linears, "native_bf16", lambda: False)
    assert not wants_bf16("auto", torch.device("cpu"))
    layer, twin = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(2, 64)
    if use_onednn(torch.nn.Sequential(twin)) == 0:
        pytest.skip("this torch build has no oneDNN linear kernel")
    model = torch.nn.Sequential(layer)
    use_onednn(model, bf16=True)
    assert not in_bf16(model)
    with torch.inference_mode():
        assert torch.equal(layer(x), twin(x))


@pytest.mark.ci_long  # a second recognizer loaded and run: ~6 s (tests/conftest.py)
def test_precision_fp32_keeps_fp32_and_auto_hears_the_same_words(ears, speak):
    """--asr-precision: "fp32" never computes in bfloat16; "auto" (the default, as `ears`
    was made) does where the CPU can, and hears clear speech as fp32 does."""
    assert not wants_bf16("fp32", torch.device("cpu"))
    assert not wants_bf16("auto", torch.device("cuda"))
    native = linears.native_bf16()
    assert in_bf16(ears.whisper.encoder) == native
    assert in_bf16(ears.moonshine.model.model.encoder) == native
    # The decoders' probabilities gate silence, read drafts and pick transcripts: fp32.
    assert not in_bf16(ears.whisper.decoder) and not in_bf16(ears.moonshine.model.model.decoder)
    exact = Ears(Transcriber(model="base", precision="fp32"), Moonshine(precision="fp32"))
    assert not in_bf16(exact.whisper.model) and not in_bf16(exact.moonshine.model)
    for text in ("What is the capital of France?", "What do bees make?"):
        audio = speak(text)
        assert words(ears.hear(audio)[0]) == words(exact.hear(audio)[0]) == words(text)
        states, fp32 = ears.whisper.encode(audio), exact.whisper.encode(audio)
        assert states is not None and fp32 is not None
        assert torch.equal(states, fp32) != native


# --- both recognizers --------------------------------------------------------------------------


def test_ears_take_the_transcript_both_models_find_likelier(ears, speak):
    # espeak's en-us+f3 voice at 150 wpm: Whisper base hears "How many people are there in a
    # week?", Moonshine "days"; forced through both decoders, "days" wins by a wide margin.
    audio = speak("How many days are there in a week?", "en-us+f3", 150)
    enc = ears.whisper.encode(audio)
    alone, _ = ears.whisper.decode(enc)
    assert "days" not in words(alone), alone  # else this test shows nothing
    before = dict(ears.picked)
    text, confidence = ears.hear(audio)
    assert words(text) == words("How many days are there in a week?"), (alone, text)
    assert ears.picked["moonshine"] == before["moonshine"] + 1
    assert confidence > -1.0
    # Each model scores its own transcript higher: the sum decides.
    m_enc = ears.moonshine.encode(audio)
    assert ears.whisper.score(enc, alone)[0] > ears.whisper.score(enc, text)[0]
    assert ears.moonshine.score(m_enc, text)[0] > ears.moonshine.score(m_enc, alone)[0]


def _same_heard(spread: tuple[str, float], alone: tuple[str, float], exact: bool) -> bool:
    """The same transcript and confidence: to the bit where the encoder's states do not
    depend on its threads (``exact``), else the confidence within 5e-3."""
    if exact:
        return spread == alone
    return spread[0] == alone[0] and spread[1] == pytest.approx(alone[1], abs=5e-3)


def test_ears_spread_over_the_cores_hear_the_same_to_the_bit(ears, speak, monkeypatch):
    # The schedule a lone hearing runs (Whisper's encoder on every core, then Whisper's
    # decoding beside Moonshine): the same transcript and confidence as the two side by
    # side, here where they disagree (both transcripts scored, the two scorings at once)
    # and in silence; torch's thread count is put back. To the bit where the encoder's
    # states are (fp32 anywhere; bfloat16 on the AMD EPYC host); bfloat16 on an Intel
    # host's AMX tiles sums in a different order on two threads (states up to 0.1 apart
    # on a 3 s window: docs/performance.md, "A slower 2-core host"), and there the same
    # transcript with a confidence in the fourth decimal is what holds.
    audio = speak("How many days are there in a week?", "en-us+f3", 150)
    with torch_threads(1):  # as the engine runs (one thread a unit)
        one = ears.whisper.encode(audio)
        with torch_threads(spread_threads()):
            exact = torch.equal(one, ears.whisper.encode(audio))
        side_by_side = ears.hear(audio)
        picked = dict(ears.picked)
        counts: list[int] = []
        set_threads = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), set_threads(n)))
        assert _same_heard(ears.hear(audio, spread=True), side_by_side, exact)
        monkeypatch.undo()
        assert ears.picked["moonshine"] == picked["moonshine"] + 1
        assert torch.get_num_threads() == 1
        # Whisper alone: its encoder spread, its decoding on the caller's one thread (the
        # sums over its vocabulary differ in the last bits on two: a CI run saw 3e-8).
        assert _same_heard(ears.whisper.hear(audio, spread=True), ears.whisper.hear(audio), exact)
    cores = spread_threads()
    assert counts == ([] if cores == 1 else [cores, 1])
    assert ears.hear(np.zeros(16000, np.float32), spread=True) == ("", float("-inf"))
    noise = (np.random.default_rng(0).standard_normal(32000) * 1e-4).astype(np.float32)
    assert ears.hear(noise, spread=True)[0] == ""


def test_ears_agree_on_clear_speech(ears, speak):
    before = ears.picked["agree"]
    said = "Can you tell me the weather for tomorrow morning?"
    text, confidence = ears.hear(speak(said))
    assert words(text) == words(said)
    assert ears.picked["agree"] == before + 1
    assert confidence > -0.5
    assert set(ears.last_timings) == {"whisper", "moonshine", "both", "scoring"}


def test_ears_hear_nothing_in_silence(ears):
    assert ears.hear(np.zeros(16000, np.float32)) == ("", float("-inf"))
    noise = (np.random.default_rng(0).standard_normal(32000) * 1e-4).astype(np.float32)
    assert ears.transcribe(noise) == ""


def test_the_worker_setting_reaches_the_engine():
    from omnifabric.common.config import ConfigError
    from omnifabric.worker.config import WorkerConfig
    from omnifabric.worker.engines.reference.engine import ReferenceEngine
    from omnifabric.worker.engines.registry import ENGINES

    assert ENGINES["reference"](WorkerConfig()).asr_choice == "both"
    assert ENGINES["reference"](WorkerConfig(asr="whisper")).asr_choice == "whisper"
    with pytest.raises(ConfigError, match="OMNI_WORKER_ASR must be one of both, whisper"):
        WorkerConfig(asr="moonshine")
    with pytest.raises(ValueError, match="choose one of both, whisper"):
        ReferenceEngine(asr="moonshine")
    assert ENGINES["reference"](WorkerConfig()).asr_precision == "auto"
    assert ENGINES["reference"](WorkerConfig(asr_precision="fp32")).asr_precision == "fp32"
    with pytest.raises(ConfigError, match="OMNI_WORKER_ASR_PRECISION must be one of auto, fp32"):
        WorkerConfig(asr_precision="bf16")
    with pytest.raises(ValueError, match="choose one of auto, fp32"):
        ReferenceEngine(asr_precision="half")


def test_scores_many_transcripts_at_once(ms, speak):
    enc = ms.encode(speak("How many legs does a spider have?"))
    found = ms.hypothesis(enc)
    texts = [found.text, "How many lands does a spider have?", "Spider"]
    one_by_one = [ms.score(enc, t) for t in texts]
    batched = ms.score_many(enc, texts, found.cross)
    for (a, n), (b, m) in zip(one_by_one, batched, strict=True):
        assert n == m and a == pytest.approx(b, abs=1e-3)


def test_ears_give_whisper_the_context(ears, speak, monkeypatch):
    # Where the two disagree (test_ears_take_the_transcript_both_models_find_likelier),
    # Whisper decodes and scores under the same prompt.
    audio = speak("How many days are there in a week?", "en-us+f3", 150)
    seen: list[tuple[str, str | None]] = []
    whisper = ears.whisper
    for name in ("hypothesis", "score"):
        method = getattr(whisper, name)

        def spy(*args, _method=method, _name=name, **kwargs):
            bound = inspect.signature(_method).bind(*args, **kwargs)
            seen.append((_name, bound.arguments.get("context")))
            return _method(*args, **kwargs)

        monkeypatch.setattr(whisper, name, spy)
    context = "Anna, Oliver."
    text, confidence = ears.hear(audio, context)
    assert words(text) == words("How many days are there in a week?")
    assert seen == [("hypothesis", context), ("score", context)], seen
