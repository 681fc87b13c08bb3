"""The batched vocoder (worker/engines/minicpmo/vocoder_batch.py) gives each session what
`Token2wav.stream` of minicpmo-utils gives it alone.

Tiny random-weight assets (tools/vocoder_assets.py) on the CPU, float32, three espeak-ng
voices of different lengths (so different prompt lengths, one shorter than a chunk). Each
session keeps two states: one advanced only by `BatchedVocoder.run` over all sessions of a
tick, one only by the package's `stream` for that session alone (the same DeviceToken2wav,
its caches swapped in). Sessions join at different ticks, stream several 28-token chunks,
and leave through a last chunk with tokens, an empty flush, or not at all; every tick compares
each session's PCM (int16, within PCM_LSB) and both caches (within CACHE_ATOL). A control
perturbs one session's caches on the batched side only: the comparison must flag that session
and no other.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stepaudio2")
torch = pytest.importorskip("torch")

from omnifabric.tools import vocoder_assets  # noqa: E402
from omnifabric.worker.engines.minicpmo import vocoder, vocoder_flow  # noqa: E402
from omnifabric.worker.engines.minicpmo.vocoder_batch import (  # noqa: E402
    BatchedVocoder,
    VocoderJob,
    pcm16,
)
from tests.worker.minicpmo.conftest import DEVICE  # noqa: E402

#: Largest int16 difference allowed between the batched and the lone session's samples.
PCM_LSB = 2
#: Largest absolute difference allowed between their caches (float32 rounding of batching).
CACHE_ATOL = 1e-4
#: espeak-ng texts: ~0.6 s (a prompt shorter than one chunk's 50 mel frames), ~2 s, ~5 s.
TEXTS = (
    "Hi.",
    "Hello there, this is the second voice.",
    "A much longer voice prompt, spoken slowly, to give a longer prompt than the others.",
)
CHUNK = 28  # 25 fresh tokens + 3 lookahead


@pytest.fixture(scope="module")
def t2w(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A DeviceToken2wav on tiny assets (their random weights make audio depend on its input:
    vocoder_assets.liven), on one torch thread (several oversubscribe a busy machine: ~15 s a
    chunk instead of ~0.15 s); on the CPU unless OMNI_MINICPMO_DEVICE names a GPU, there
    with TF32 off (with it, batched and lone calls pick kernels 9 LSB apart)."""
    threads = torch.get_num_threads()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    folder = tmp_path_factory.mktemp("token2wav")
    vocoder_assets.build(folder)
    out = vocoder.make(folder, device=DEVICE, n_timesteps=10)
    yield out
    torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.fixture(scope="module")
def voices(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three voice WAVs of different lengths."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (the voices are spoken with it)")
    folder = tmp_path_factory.mktemp("voices")
    out = []
    for i, text in enumerate(TEXTS):
        path = folder / f"voice{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        out.append(str(path))
    return out


def clone(cache: dict[str, Any]) -> dict[str, Any]:
    """A copy owning its tensors (made in inference mode, as the package's caches are)."""
    with torch.inference_mode():
        return {key: value.clone() for key, value in cache.items()}


@dataclass
class Session:
    """One session's plan and its two states (batched, alone)."""

    voice: str
    start: int  # the tick of its first chunk
    chunks: int  # full chunks
    end: int | None  # tokens of its last chunk (0: an empty flush); None: it stays open
    flow: dict[str, Any] = field(default_factory=dict)
    hift: dict[str, Any] = field(default_factory=dict)
    alone_flow: dict[str, Any] = field(default_factory=dict)
    alone_hift: dict[str, Any] = field(default_factory=dict)
    pcm: bytes = b""  # its latest batched output

    def call(self, tick: int, rng: np.random.Generator) -> tuple[list[int], bool] | None:
        """This tick's (tokens, last_chunk), or None when the session is not streaming."""
        k = tick - self.start
        if 0 <= k < self.chunks:
            return rng.integers(0, 6561, CHUNK).tolist(), False
        if k == self.chunks and self.end is not None:
            return rng.integers(0, 6561, self.end).tolist(), True
        return None


def start(t2w: Any, session: Session) -> None:
    """Both states of a new session, from set_stream_cache."""
    flow, hift = t2w.set_stream_cache(session.voice)
    session.flow, session.hift = clone(flow), clone(hift)
    session.alone_flow, session.alone_hift = clone(flow), clone(hift)


def alone(t2w: Any, session: Session, tokens: list[int], last: bool) -> bytes:
    """The package's stream() for this session alone, on its own state."""
    t2w.stream_cache, t2w.hift_cache_dict = session.alone_flow, session.alone_hift
    t2w._stream_prompt = session.voice
    pcm = t2w.stream(tokens, prompt_wav=session.voice, last_chunk=last)
    # Cloned: the package's own flow caches may be views of its scratch buffers.
    session.alone_flow, session.alone_hift = clone(t2w.stream_cache), t2w.hift_cache_dict
    return bytes(pcm)


def compare(pcm: bytes, expected: bytes, caches: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs beyond the tolerances: PCM (length, samples) and caches (keys, shapes,
    values; integer offsets exactly)."""
    problems = []
    got, ref = np.frombuffer(pcm, "<i2").astype(int), np.frombuffer(expected, "<i2").astype(int)
    if got.shape != ref.shape:
        problems.append(f"pcm: {got.size} samples, not {ref.size}")
    elif got.size and np.abs(got - ref).max() > PCM_LSB:
        problems.append(f"pcm: differs by {np.abs(got - ref).max()} LSB")
    if caches.keys() != want.keys():
        problems.append(f"cache keys {sorted(caches)} != {sorted(want)}")
    for key in caches.keys() & want.keys():
        a, b = caches[key], want[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)}, not {tuple(b.shape)}")
        elif not a.is_floating_point():
            if not torch.equal(a, b):
                problems.append(f"{key}: {a.tolist()}, not {b.tolist()}")
        elif a.numel() and (a.double() - b.double()).abs().max() > CACHE_ATOL:
            problems.append(f"{key}: differs by {(a.double() - b.double()).abs().max():.2e}")
    return problems


def tick(
    t2w: Any, batched: BatchedVocoder, sessions: list[Session], at: int, rng: np.random.Generator
) -> dict[int, list[str]]:
    """One step: every streaming session through run() and alone; problems per session."""
    jobs, expected, rows = [], [], []
    for i, session in enumerate(sessions):
        call = session.call(at, rng)
        if call is None:
            continue
        if at == session.start:
            start(t2w, session)
        tokens, last = call
        expected.append(alone(t2w, session, tokens, last))
        jobs.append(VocoderJob(tokens, last, session.flow, session.hift, session.voice))
        rows.append(i)
    problems = {}
    for i, pcm, want in zip(rows, batched.run(jobs), expected, strict=True):
        s = sessions[i]
        s.pcm = pcm
        found = compare(pcm, want, s.flow, s.alone_flow)
        found += compare(pcm, want, s.hift, s.alone_hift)
        if found:
            problems[i] = found
    return problems


def plan(voices: list[str], n: int) -> list[Session]:
    """n sessions: different voices, joining at ticks 0-2, 1-3 chunks, ending with a short
    last chunk, a 2-token last chunk, an empty flush, or not at all."""
    shapes = [(0, 2, 7), (0, 3, 0), (1, 2, None), (2, 1, 2), (0, 1, 0), (1, 3, 7), (2, 2, 0)]
    return [Session(voices[i % len(voices)], *shapes[i % len(shapes)]) for i in range(n)]


def run_plan(
    t2w: Any, sessions: list[Session], seed: int = 0, static: bool = False
) -> BatchedVocoder:
    """Every tick of the plan; fails on the first tick with a difference. Static: the flow
    matching in static shapes (CUDA graphs on CUDA)."""
    batched = BatchedVocoder(t2w, static=static, graphs=static)
    rng = np.random.default_rng(seed)
    ticks = max(s.start + s.chunks + 1 for s in sessions)
    for at in range(ticks):
        assert tick(t2w, batched, sessions, at, rng) == {}, f"tick {at}"
    return batched


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_sessions_equal_each_alone(t2w: Any, voices: list[str], n: int) -> None:
    run_plan(t2w, plan(voices, n), seed=n)


def test_five_timesteps(t2w: Any, voices: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(t2w, "n_timesteps", 5)
    sessions = plan(voices, 3)
    run_plan(t2w, sessions, seed=5)
    assert sessions[0].flow["estimator_att_cache"].shape[0] == 5


def test_session_joins_mid_stream(t2w: Any, voices: list[str]) -> None:
    # The newcomer's first chunk (no decode history, first-chunk silence) beside a session in
    # steady state whose estimator cache is already trimmed.
    sessions = [Session(voices[0], 0, 5, None), Session(voices[1], 4, 2, 0)]
    run_plan(t2w, sessions, seed=7)


def test_comparison_detects_a_perturbed_session(t2w: Any, voices: list[str]) -> None:
    sessions = [Session(voices[i % len(voices)], 0, 2, None) for i in range(4)]
    batched, rng = BatchedVocoder(t2w), np.random.default_rng(1)
    assert tick(t2w, batched, sessions, 0, rng) == {}
    first, second = (np.frombuffer(s.pcm, "<i2").astype(int) for s in sessions[:2])
    assert np.abs(first - second).max() > 100 * PCM_LSB  # the audio depends on the session
    with torch.inference_mode():  # on the batched side only; session 3 untouched
        sessions[0].flow["estimator_att_cache"][..., -1, :] += 1e-2
        sessions[1].hift["phase"] += 0.25
        sessions[2].hift["mel"] += 1.0
    problems = tick(t2w, batched, sessions, 1, rng)
    assert sorted(problems) == [0, 1, 2], problems
    assert any(p.startswith("estimator_att_cache") for p in problems[0]), problems[0]
    assert any(p.startswith("phase") for p in problems[1]), problems[1]
    assert any(p.startswith("pcm") for p in problems[2]), problems[2]


def test_rejects_as_stream_does(t2w: Any, voices: list[str]) -> None:
    session = Session(voices[1], 0, 1, 0)
    start(t2w, session)
    batched = BatchedVocoder(t2w)
    before = clone(session.flow)
    short = VocoderJob([1, 2, 3], False, session.flow, session.hift, session.voice)
    with pytest.raises(ValueError, match="lookahead"):
        batched.run([short])
    assert compare(b"", b"", session.flow, before) == []
    flush = VocoderJob([], True, session.flow, session.hift, session.voice)
    pcm = batched.run([flush])[0]
    assert compare(pcm, alone(t2w, session, [], True), session.hift, session.alone_hift) == []
    # Finalized: an empty flush gives nothing (as stream does), tokens are refused.
    assert batched.run([flush]) == [alone(t2w, session, [], True)] == [b""]
    again = VocoderJob([5] * CHUNK, True, session.flow, session.hift, session.voice)
    with pytest.raises(ValueError, match="finalized"):
        batched.run([again])


def test_int16_conversion_is_the_packages_to_the_bit() -> None:
    """All rows' speech is converted at once on the device; each sample must be exactly what
    stream()'s numpy conversion gives (values past full scale, halves, signed zeros, tiny)."""
    rng = np.random.default_rng(3)
    edges = np.array([-1.5, -1.0, -0.99999, -0.5, -1e-9, -0.0, 0.0, 1e-9, 0.5, 0.99999, 1.0, 2.0])
    halves = (np.arange(-32767, 32767, 97) + 0.5) / 32767.0
    speech = np.concatenate([edges, halves, rng.uniform(-1.2, 1.2, 20_000)]).astype(np.float32)
    want = (np.clip(speech, -1.0, 1.0) * 32767.0).astype("<i2")
    got = pcm16(torch.from_numpy(speech)[None].to(DEVICE))
    assert got.dtype == np.dtype("<i2") and got.tobytes() == want.tobytes()


def test_a_non_finite_row_fails_the_call_before_any_first_chunk_is_spent(
    t2w: Any, voices: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = [Session(voices[i], 0, 2, None) for i in range(2)]
    for session in sessions:
        start(t2w, session)
    batched = BatchedVocoder(t2w)
    stream = batched.hift.stream

    def broken(caches: Any, mels: Any, finals: Any) -> list[Any]:
        out = stream(caches, mels, finals)
        out[1][0, 5] = float("nan")
        return out

    monkeypatch.setattr(batched.hift, "stream", broken)
    jobs = [VocoderJob([7] * CHUNK, False, s.flow, s.hift, s.voice) for s in sessions]
    with pytest.raises(RuntimeError, match="non-finite"):
        batched.run(jobs)
    assert all(int(s.hift["first_chunk"].item()) == 1 for s in sessions)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_static_shapes_equal_each_alone(t2w: Any, voices: list[str], n: int) -> None:
    # Buckets of rows (1, 4, 8), chunk frames (50 -> 56, a 7-token last chunk's 14 -> 16)
    # and cached keys (multiples of 128): padding rows, frames and keys beside real ones.
    batched = run_plan(t2w, plan(voices, n), seed=10 + n, static=True)
    flow, decoder = batched.flow, batched.hift.decoder
    assert len(flow.buckets) > 1 and len(decoder.shapes) > 1, (flow.buckets, decoder.shapes)
    if DEVICE.startswith("cuda"):  # there the flow's steps and the HiFT's spectra replayed
        assert flow.failure is None and flow.captured > 0 and flow.replays > 0
        assert decoder.failure is None and decoder.captured > 0 and decoder.replays > 0


def test_static_shapes_session_joins_mid_stream(t2w: Any, voices: list[str]) -> None:
    sessions = [Session(voices[0], 0, 5, None), Session(voices[1], 4, 2, 0)]
    run_plan(t2w, sessions, seed=7, static=True)


@pytest.mark.parametrize("broken", ["mask", "ends"])
def test_static_comparison_fails_without_the_padding_rules(
    t2w: Any, voices: list[str], monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    # Controls: padded keys seen by every row, or every row's convolution cache taken at the
    # padded chunk's end instead of its own: the comparison must fail.
    fill = vocoder_flow._fill

    def wrong(call: Any, *args: Any) -> None:
        fill(call, *args)
        if broken == "mask":
            call.mask.fill_(True)
        else:
            call.ends.fill_(call.x2.shape[2])

    monkeypatch.setattr(vocoder_flow, "_fill", wrong)
    sessions = [Session(voices[i % len(voices)], 0, 2, None) for i in range(3)]
    batched, rng = BatchedVocoder(t2w, static=True), np.random.default_rng(3)
    problems = tick(t2w, batched, sessions, 0, rng)
    problems.update(tick(t2w, batched, sessions, 1, rng))
    assert sorted(problems) == [0, 1, 2], problems


def test_a_failed_capture_runs_eagerly(t2w: Any, voices: list[str]) -> None:
    # Graphs asked where no capture can succeed (on a CPU the pool itself cannot be made; on
    # a GPU a capture can fail for reasons of its own): the first call turns them off with
    # the reason kept, and every session still gets the package's audio.
    sessions = [Session(voices[i % len(voices)], i % 2, 2, 0) for i in range(3)]
    batched, rng = BatchedVocoder(t2w, static=True), np.random.default_rng(4)
    parts = (batched.flow, batched.hift.decoder)
    for part in parts:
        part.graphs = True
        part.capture = lambda fn, part=part: type(part).capture(part, _failing(fn))
    for at in range(4):
        assert tick(t2w, batched, sessions, at, rng) == {}, f"tick {at}"
    for part in parts:
        assert not part.graphs and part.failure, part.failure
        assert part.replays == 0


def _failing(fn: Any) -> Any:
    def run() -> Any:
        raise RuntimeError("no capture here")

    return run


def test_static_calls_past_the_kept_buckets_run_ragged(
    t2w: Any, voices: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One bucket kept by each part: every call in another runs the ragged path beside it.
    from omnifabric.worker.engines.minicpmo.vocoder_batch import HiftDecoder

    monkeypatch.setattr(vocoder_flow, "MAX_SHAPES", 1)
    monkeypatch.setattr(HiftDecoder, "MAX_SHAPES", 1)
    batched = run_plan(t2w, plan(voices, 3), seed=21, static=True)
    assert len(batched.flow._shapes) == len(batched.flow.buckets) == 1
    assert len(batched.hift.decoder.shapes) == 1


@pytest.mark.parametrize("tf32", [True, False])
def test_the_vocoders_flow_runs_in_tf32_only_where_it_was_made_so(
    t2w: Any, voices: list[str], tf32: bool
) -> None:
    """Every product of the flow (its encoder's and its estimator's linear layers) in a
    voice's preparation, a lone stream and a batched call sees TF32 exactly where the
    vocoder was made so, the HiFT's never (its F0 predictor feeds a phase); the process's
    setting is as it was after each (vocoder.precision)."""
    matmul = torch.backends.cuda.matmul
    seen: dict[str, list[bool]] = {"flow": [], "hift": []}

    def watch(part: Any, name: str) -> list[Any]:
        return [
            module.register_forward_pre_hook(lambda *_: seen[name].append(matmul.allow_tf32))
            for module in part.modules()
            if isinstance(module, torch.nn.Linear)
        ]

    hooks = watch(t2w.flow, "flow") + watch(t2w.hift, "hift")
    before, t2w.tf32 = getattr(t2w, "tf32", False), tf32

    def check() -> None:
        assert seen["flow"] and set(seen["flow"]) == {tf32}, seen["flow"]
        assert set(seen["hift"]) <= {False} and matmul.allow_tf32 is False
        seen["flow"].clear()
        seen["hift"].clear()

    try:
        session = Session(voices[1], 0, 1, None)
        t2w.voices.clear()  # prepared afresh: its flow pass is watched too
        t2w.cache = None
        start(t2w, session)
        check()
        alone(t2w, session, list(range(3, 3 + CHUNK)), False)
        assert seen["hift"]  # the HiFT ran (its F0 predictor's classifier)
        check()
        tokens = list(range(5, 5 + CHUNK))
        job = VocoderJob(tokens, False, session.flow, session.hift, session.voice)
        BatchedVocoder(t2w).run([job])
        assert seen["hift"]
        check()
    finally:
        t2w.tf32 = before
        for hook in hooks:
            hook.remove()
