"""Voices prepared once and shared by their sessions (worker/engines/minicpmo/vocoder.py:
`Voice`, `shared_base`, `share_kept`).

Tiny random-weight vocoder assets on the CPU, float32. What a session gets from a voice the
vocoder already holds must be what the package's own `set_stream_cache` gives it: the same
caches, then the same PCM chunk by chunk.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stepaudio2")
torch = pytest.importorskip("torch")

from omnifabric.tools import vocoder_assets  # noqa: E402
from omnifabric.worker.engines.minicpmo import vocoder  # noqa: E402

CHUNK = 28  # 25 fresh tokens + 3 lookahead


@pytest.fixture(scope="module")
def t2w(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A DeviceToken2wav on tiny assets on the CPU, one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("token2wav")
    vocoder_assets.build(folder)
    yield vocoder.make(folder, device="cpu", n_timesteps=5)
    torch.set_num_threads(threads)


@pytest.fixture()
def flow_passes(t2w: Any) -> Iterator[list[int]]:
    """Counts the flow's passes over a voice (setup_cache) while the test runs."""
    calls: list[int] = []
    made = t2w.flow.setup_cache

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return made(*args, **kwargs)

    t2w.flow.setup_cache = counted
    yield calls
    t2w.flow.setup_cache = made


def speak(path: Path, text: str) -> str:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (the voices are spoken with it)")
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return str(path)


def stream(t2w: Any, chunks: list[list[int]]) -> list[bytes]:
    """The PCM of `chunks` streamed from the vocoder's current stream (the last one final)."""
    return [t2w.stream(tokens, last_chunk=i == len(chunks) - 1) for i, tokens in enumerate(chunks)]


def tokens(seed: int, count: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 6561, CHUNK).tolist() for _ in range(count)]


def package_stream(t2w: Any, path: str, chunks: list[list[int]]) -> tuple[dict, list[bytes]]:
    """The package's own set_stream_cache (the voice prepared and its flow pass made here,
    nothing kept), then `chunks`: its caches and PCM."""
    t2w.cache = None
    vocoder._BASE.set_stream_cache(t2w, path)
    t2w.stream_cache = vocoder.owned(t2w.stream_cache, t2w.n_timesteps)
    caches = dict(t2w.stream_cache)
    return caches, stream(t2w, chunks)


def test_a_held_voice_gives_what_the_package_gives(t2w, flow_passes, tmp_path):
    """A second session of a voice (another file of the same audio, the prepared voices
    emptied as the model code empties them) gets no new flow pass, and the same caches
    and PCM as the package's own preparation of that voice."""
    first = speak(tmp_path / "a.wav", "Hello there, this is a voice.")
    second = str(tmp_path / "b.wav")
    shutil.copy(first, second)
    chunks = tokens(1)
    t2w.cache = None
    t2w.set_stream_cache(first)
    held = t2w.voice
    assert flow_passes == [1]
    t2w.cache = None
    caches, _ = t2w.set_stream_cache(second)
    assert flow_passes == [1] and t2w.voice is held
    got = dict(caches)  # stream() replaces the dict; its tensors stay as they were
    pcm = stream(t2w, chunks)
    want, want_pcm = package_stream(t2w, second, chunks)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
        assert got[name].is_inference() == value.is_inference(), name
    assert pcm == want_pcm and all(pcm)
    # the session's stream caches are copies: streaming did not touch the voice's
    for name, value in held.items():
        assert torch.equal(value, want[name]), name


def test_new_audio_at_a_known_path_is_a_new_voice(t2w, flow_passes, tmp_path):
    """Voices are told apart by their audio, not their file's name."""
    path = tmp_path / "voice.wav"
    speak(path, "The first voice.")
    t2w.cache = None
    t2w.set_stream_cache(str(path))
    first = t2w.voice
    speak(path, "Quite another voice, and a longer one too.")
    t2w.cache = None
    t2w.set_stream_cache(str(path))
    assert flow_passes == [1, 1] and t2w.voice is not first
    want, _ = package_stream(t2w, str(path), [])
    assert want["estimator_att_cache"].shape == t2w.voice["estimator_att_cache"].shape
    assert torch.equal(want["estimator_att_cache"], t2w.voice["estimator_att_cache"])


def test_a_voice_lives_while_something_holds_it(t2w, flow_passes, tmp_path):
    path = speak(tmp_path / "v.wav", "A voice that comes and goes.")
    t2w.cache = None
    t2w.set_stream_cache(path)
    kept = {"flow_cache_base": {k: v.clone() for k, v in t2w.stream_cache.items()}}
    vocoder.share_kept(type("M", (), {"tts": type("T", (), {"audio_tokenizer": t2w})})(), kept)
    voice = kept["flow_cache_base"]
    assert isinstance(voice, vocoder.Voice) and voice is t2w.voice
    assert vocoder.voice_bytes(t2w) >= vocoder.cache_bytes(voice) > 0
    t2w.voice = None
    gc.collect()
    assert voice in t2w.voices.values()  # a session's base holds it
    del kept, voice
    gc.collect()
    assert len(t2w.voices) == 0
    t2w.cache = None
    t2w.set_stream_cache(path)
    assert flow_passes == [1, 1]  # prepared again once nothing held it


def test_a_kept_base_is_shared_only_where_it_is_the_voice(t2w, tmp_path):
    path = speak(tmp_path / "s.wav", "Shared or not.")
    t2w.cache = None
    t2w.set_stream_cache(path)
    voice = t2w.voice
    same = {k: v.clone() for k, v in voice.items()}
    assert vocoder.shared_base(t2w, same) is voice
    assert vocoder.shared_base(t2w, voice) is voice
    assert vocoder.shared_base(t2w, None) is None
    changed = {k: v.clone() for k, v in voice.items()}
    changed["estimator_att_cache"].view(-1)[7] += 1e-3
    assert vocoder.shared_base(t2w, changed) is changed
    fewer = {k: v for k, v in same.items() if k != "conformer_cnn_cache"}
    assert vocoder.shared_base(t2w, fewer) is fewer
    longer = dict(same, estimator_att_cache=torch.cat([same["estimator_att_cache"]] * 2, 4))
    assert vocoder.shared_base(t2w, longer) is longer
