"""The /audio page's end-of-speech rule (edge/web/js/capture.js `SpeechEnd`) against the
edge's own (edge/cadence.py `SpeechEnd`), which it copies: fed the same stream in the
page's 100 ms chunks, both make a cut due after the same chunks. Runs the page's module
in Node (skips without it)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from omnifabric.edge.cadence import SpeechEnd
from omnifabric.tools.eval_reference import PAGE_CHUNK, speech_cut_units

CAPTURE_JS = Path(__file__).resolve().parents[2] / "edge" / "web" / "js" / "capture.js"

# Reads a float32 stream from a file, feeds SpeechEnd in 100 ms chunks, prints the chunks
# after which a cut was due (and made), as JSON.
NODE_SCRIPT = """
import { readFileSync } from 'node:fs';
import { SpeechEnd } from './capture.mjs';
const bytes = readFileSync(process.argv[2]);
const audio = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4);
const end = new SpeechEnd();
const cuts = [];
for (let i = 0, n = 0; i < audio.length; i += %d, n++) {
  end.feed(audio.subarray(i, i + %d));
  if (end.cutDue) { end.cut(); cuts.push(n); }
}
console.log(JSON.stringify(cuts));
"""


def _stream(rng: np.random.Generator) -> np.ndarray:
    """Noise, then speech-like bursts (a tone with a syllable envelope) with pauses of
    0.1-0.8 s between them, a quieter talker, and a line too noisy to ever look quiet."""
    sr = 16000

    def quiet(s: float, level: float = 0.002) -> np.ndarray:
        return rng.normal(0, level, int(s * sr)).astype(np.float32)

    def speech(s: float, loud: float) -> np.ndarray:
        t = np.arange(int(s * sr)) / sr
        envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
        return (loud * envelope * np.sin(2 * np.pi * 180 * t)).astype(np.float32)

    parts = [quiet(0.7)]
    for s, pause in ((1.3, 0.1), (0.9, 0.15), (0.6, 0.8), (1.1, 0.35), (0.4, 1.2)):
        parts += [speech(s, 0.2), quiet(pause)]
    parts += [speech(1.0, 0.03), quiet(0.9)]  # a quiet talker: its own peak sets the share
    parts += [speech(1.0, 0.2), quiet(1.0, level=0.05)]  # a noisy line: never quiet enough
    return np.concatenate(parts)


def _edge_cuts(audio: np.ndarray) -> list[int]:
    end, cuts = SpeechEnd(), []
    for n, i in enumerate(range(0, audio.size, PAGE_CHUNK)):
        end.feed(audio[i : i + PAGE_CHUNK])
        if end.cut_due:
            end.cut()
            cuts.append(n)
    return cuts


def test_the_pages_speech_end_cuts_where_the_edges_does(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is missing (it comes with npm): the page's module cannot run here")
    shutil.copy(CAPTURE_JS, tmp_path / "capture.mjs")
    (tmp_path / "run.mjs").write_text(NODE_SCRIPT % (PAGE_CHUNK, PAGE_CHUNK))
    audio = _stream(np.random.default_rng(7))
    (tmp_path / "stream.f32").write_bytes(audio.astype("<f4").tobytes())
    done = subprocess.run(
        [node, str(tmp_path / "run.mjs"), str(tmp_path / "stream.f32")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    page = json.loads(done.stdout)
    edge = _edge_cuts(audio)
    assert page == edge
    # Not a vacuous agreement: the long pauses cut (twice: a second cut 0.3 s after the
    # first), the 0.1 s and 0.15 s ones do not, nor the noisy line's quiet.
    chunk_s = PAGE_CHUNK / 16000
    times = [round((n + 1) * chunk_s, 1) for n in edge]
    assert 4 <= len(edge) <= 8, times
    assert all(t > 2.6 for t in times), times  # nothing in the first two short pauses
    assert times[-1] < audio.size / 16000 - 1.5, times  # nothing on the noisy line


def test_units_cut_where_speech_stops_keep_the_stream_whole():
    """``speech_cut_units`` (what the eval sends for --speech-cuts): the same audio, units
    of whole seconds or cut short after speech (never under the engines' shortest, 4000
    samples); what is left at the end is made a whole second with silence."""
    audio = _stream(np.random.default_rng(3))
    seconds = [audio[i : i + 16000] for i in range(0, audio.size, 16000)]
    seconds[-1] = np.pad(seconds[-1], (0, 16000 - seconds[-1].size))
    units = speech_cut_units(seconds)
    joined = np.concatenate(units)
    assert np.array_equal(joined[: audio.size], audio)
    assert not joined[audio.size :].any()
    short = [u.size for u in units if u.size < 16000]
    assert short and all(4000 <= n < 16000 for n in short)
    assert all(u.size <= 16000 for u in units)
    assert speech_cut_units([]) == []
