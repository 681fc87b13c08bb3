"""The edge's one owner of the unit cadence: how a client's stream of audio, of any length,
becomes the worker's units. Sans-I/O: it holds samples and a little state, the connection
driver (edge.connection) feeds it, clocks it and sends what it says is due. Dialects only
hand it decoded audio (ev.AudioCommand) and say when the model's turn must end
(ev.EndTurnCommand) or the held audio is moot (ev.ClearAudioCommand); none keeps a clock.

Two cadences, named by a dialect's traits:
- `cut` (half-duplex calls): audio gathers until it reaches the worker's shortest unit,
  then all of it goes, in as few units as the longest allows, equal parts. The session's
  clock is the worker's (it feeds silence to an answer itself), so nothing is paced.
- `paced` (the OpenAI dialect's server-VAD sessions): one unit of UNIT_SAMPLES in flight
  at a time, the next once the last was answered; when the client sends less than real
  time the rest of the unit is silence, so the session's clock never stops and a reply
  never waits for more input. Audio sent while the session waits for a worker is held
  (MAX_BACKLOG_S at most, the oldest dropped and counted). Where speech stops inside a
  unit (`SpeechEnd`: CUT_QUIET_S of quiet after speech) and the worker's engine takes
  units as they come (not re-chunked: SessionStarted.units_as_sent), what came
  goes at once as a shorter unit, so the engine hears the end of a question as soon as it
  can tell it, not when the unit's second is up (a client of whole units gives it that
  late; this one's audio comes as it is spoken).

Units are float32 16 kHz PCM, the rate every engine hears; audio at another rate goes
through one streaming resampler per cadence as it arrives (edge.pcm.Resampler: a low-pass,
no seam between pieces, a few ms held back), and what is held waits at 16 kHz. The
resampler's hold-back is paid once, as that much silence before its stream: the 16 kHz
audio runs ~4 ms behind the client's, and a unit is whole as soon as the client's audio
covering it has come (without it, each unit waited for the client's next append: 100 ms
later with 100 ms appends).

The worker's intake (worker.rechunk) still shapes client units into the exact model
units an engine takes (MiniCPM-o's 1.035 s first unit); that is the model's cadence, this
is the client's.
"""

from __future__ import annotations

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge import pcm

#: The rate units are sent at (what the engines hear).
UNIT_RATE = 16000
#: The unit the paced cadence cuts (16 kHz samples), within the worker's bounds: one
#: second, as the duplex models take it. Also the length of the silent unit that ends a
#: model's turn.
UNIT_SAMPLES = 16000
#: How late the client's audio may be before the paced cadence fills the unit with silence.
FILL_GRACE_S = 0.25
#: A unit unanswered this many unit lengths no longer holds the next one back.
IN_FLIGHT_UNITS = 2.0
#: Audio waiting for the engine at most (seconds), paced; older audio is dropped (counted).
MAX_BACKLOG_S = 10.0
#: How often the driver clocks a paced cadence (seconds).
TICK_S = 0.1
#: The cadences a dialect may name (DuplexDialect.traits.cadence).
CUT, PACED = "cut", "paced"
#: The paced cadence's end of speech (SpeechEnd): frames this long (16 kHz samples, 20 ms)
#: are speech when louder than pcm.SPEECH_RMS, quiet when under QUIET_SHARE of the loudest
#: speech frame since the last cut (and under SPEECH_RMS); after CUT_QUIET_S of quiet
#: following speech, what is held goes as a unit of its own, and once more after
#: NEXT_CUT_QUIET_S more (CUTS in all), in case the engine wanted a little more silence to
#: end the turn: where the first came before the engine's own silence rule was met, its
#: finalize begins the reply on a guess (~0.65 s on a 2-core host) and the second, all
#: quiet, confirms it; a reply ready before the second comes waits for it. It may wait in
#: the worker for that finalize: a unit is late there only when answered later than its
#: length and a second (worker.headroom.is_late). At least the worker's shortest unit
#: (EngineLimits.min_unit_samples, 0.25 s), else it would not go as a unit of its own.
FRAME = 320
QUIET_SHARE = 0.1
CUT_QUIET_S = 0.2
NEXT_CUT_QUIET_S = 0.3
CUTS = 2
# The same rules on a frame's power (its samples' sum of squares), as feed computes them.
_SPEECH_POWER = FRAME * pcm.SPEECH_RMS**2
_QUIET_POWER_SHARE = QUIET_SHARE**2


def unit_length(bounds: tuple[int, int] | None) -> int:
    """The unit a cadence sends (16 kHz samples): UNIT_SAMPLES within the worker's bounds
    (fewest, most); UNIT_SAMPLES where the worker states none."""
    fewest, most = bounds or (UNIT_SAMPLES, UNIT_SAMPLES)
    return min(max(UNIT_SAMPLES, fewest), most)


class SpeechEnd:
    """Where speech stops in a 16 kHz stream, by loudness alone (sans-I/O, a few numpy
    operations an append): the engine decides the turn; this only says when holding the
    rest of a unit would keep the end of what was said from it. A line noisier than
    QUIET_SHARE of its speech never looks quiet here, and its units stay whole."""

    def __init__(self) -> None:
        self._rest = np.zeros(0, np.float32)
        self._peak = 0.0
        self.quiet = 0
        """Samples of quiet at the end of the stream (whole frames)."""
        self.cuts_left = 0
        """Cuts still due since speech was last heard (CUTS after speech, 0 in silence)."""

    def feed(self, audio: np.ndarray) -> None:
        """Follow more of the stream (float32, 16 kHz)."""
        if not self.cuts_left and float(np.dot(audio, audio)) <= _SPEECH_POWER:
            # Nothing to cut and no speech in it (not even one frame's worth): the usual
            # append between a user's turns costs one dot product.
            self._rest = audio[:0]
            return
        x = np.concatenate([self._rest, audio]) if self._rest.size else audio
        whole = x.size - x.size % FRAME
        self._rest = x[whole:].copy()
        if not whole:
            return
        frames = x[:whole].reshape(-1, FRAME)
        power = np.einsum("ij,ij->i", frames, frames)  # FRAME x mean square, per frame
        loud = np.flatnonzero(power > _SPEECH_POWER)
        if loud.size:
            self._peak = max(self._peak, float(power[loud].max()))
            self.quiet, self.cuts_left = 0, CUTS
            power = power[loud[-1] + 1 :]
        # the frames after the last loud one: quiet ones add up, one in between starts over
        noisy = np.flatnonzero(power >= _QUIET_POWER_SHARE * self._peak)
        if noisy.size:
            self.quiet = (power.size - noisy[-1] - 1) * FRAME
        else:
            self.quiet += power.size * FRAME

    @property
    def cut_due(self) -> bool:
        """Whether what is held should go now: speech was heard, CUT_QUIET_S of quiet
        followed it (NEXT_CUT_QUIET_S since a first cut), and a cut is still due."""
        wait = CUT_QUIET_S if self.cuts_left == CUTS else NEXT_CUT_QUIET_S
        return self.cuts_left > 0 and self.quiet >= wait * UNIT_RATE

    def cut(self) -> None:
        """The held audio went: the next cut waits for NEXT_CUT_QUIET_S of quiet more."""
        self.cuts_left -= 1
        self.quiet = 0
        if not self.cuts_left:
            self._peak = 0.0


def _pcm_bytes(audio: np.ndarray) -> bytes:
    return audio.astype("<f4").tobytes()


class Cadence:
    """What both cadences share: the held audio at its rate, the worker's unit bounds once
    the session started, and the units sent and answered."""

    #: Audio pushed before the session started is held (True) or refused as not ready.
    holds_before_start = False
    #: Seconds between the driver's clock calls (due(clock=True)); 0: no clock.
    tick_s = 0.0
    #: It cuts a unit short where speech stops (given short_units): the worker is told so
    #: (SessionStart.speech_cuts).
    speech_cuts = False

    def __init__(self) -> None:
        self._held: list[np.ndarray] = []
        self._held_n = 0
        self._rate = UNIT_RATE
        self._resampler: pcm.Resampler | None = None
        """The client's rate -> UNIT_RATE, while it is another."""
        self._lead_due = False
        """The resampler's stream has given nothing yet: its hold-back goes first as silence."""
        self.bounds: tuple[int, int] | None = None
        """(fewest, most) samples a unit of the leased worker; None before the start."""
        self.short_units = False
        """The worker's engine takes units shorter than a second as they come (not
        re-chunked into its own)."""
        self.started = False
        self.closed = False
        self.dropped_s = 0.0
        """Audio dropped because the engine fell behind (paced), seconds."""

    # ---- the driver's calls ---------------------------------------------------------

    def push(self, samples: np.ndarray, rate: int) -> None:
        """Take client audio (float32 at `rate`), held at UNIT_RATE."""
        if rate != self._rate:  # a new format: what the old converter holds comes first
            if self._resampler is not None:
                self._hold(self._resampler.flush())
            self._rate = rate
            self._resampler = pcm.Resampler(rate, UNIT_RATE) if rate != UNIT_RATE else None
            self._lead_due = self._resampler is not None
        audio = samples.astype(np.float32, copy=False)
        if self._resampler is None:
            self._hold(audio)
            return
        out = self._resampler.process(audio)
        if self._lead_due and audio.size:
            self._lead_due = False
            self._hold(np.zeros(self._resampler.held, np.float32))
        self._hold(out)

    def start(self, bounds: tuple[int, int] | None, now: float, short_units: bool = False) -> None:
        """The session started on a worker that takes units within `bounds`, as they come
        where `short_units` (else it may re-chunk them into its own)."""
        self.bounds, self.started, self.short_units = bounds, True, short_units

    def close(self) -> None:
        self.closed = True

    def clear(self) -> None:
        """Drop what is held (the dialect ignores it)."""
        self._take_all()

    def sent(self, seq: int, now: float) -> None:
        """A unit this cadence made went to the worker as `seq`."""

    def answered(self, out: ev.Output) -> None:
        """The worker answered up to `out.seq`."""

    def due(self, now: float, clock: bool) -> list[ev.AppendCommand]:
        """The units to send now (`clock`: called by the driver's clock)."""
        raise NotImplementedError

    def end_turn(self) -> list[ev.AppendCommand]:
        """The units that end the model's turn now (force_listen)."""
        raise NotImplementedError

    # ---- the held audio -------------------------------------------------------------

    @property
    def held_samples(self) -> int:
        """Samples held, at UNIT_RATE."""
        return self._held_n

    def _hold(self, audio: np.ndarray) -> None:
        if audio.size:
            self._held.append(audio)
            self._held_n += audio.size

    def _take_all(self) -> np.ndarray:
        audio = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
        self._held, self._held_n = [], 0
        return audio

    def _take(self, n: int) -> np.ndarray:
        audio = self._take_all()
        self._hold(audio[n:])
        return audio[:n]


class CutCadence(Cadence):
    """Half-duplex: gather to the shortest unit, then everything in equal parts no longer
    than the longest. Before the start nothing is held: the driver refuses the audio as
    not ready, as the protocol says."""

    def due(self, now: float, clock: bool) -> list[ev.AppendCommand]:
        if not self.started or self.closed or self.bounds is None:
            return []
        fewest, most = self.bounds
        if self._held_n < fewest:
            return []
        audio = self._take_all()
        total = audio.size
        parts = -(-total // most)
        cuts = [total * i // parts for i in range(parts + 1)]
        return [
            ev.AppendCommand(pcm=_pcm_bytes(audio[a:b]))
            for a, b in zip(cuts, cuts[1:], strict=False)
        ]

    def end_turn(self) -> list[ev.AppendCommand]:
        """One unit of silence with force_listen (the worker's answer ends with it)."""
        silence = np.zeros(unit_length(self.bounds), np.float32)
        return [ev.AppendCommand(pcm=_pcm_bytes(silence), force_listen=True)]


class PacedCadence(Cadence):
    """Real-time sessions: one unit in flight, silence when the client is late."""

    holds_before_start = True
    tick_s = TICK_S
    speech_cuts = True

    def __init__(self) -> None:
        super().__init__()
        self._in_flight = 0
        self._sent_at = 0.0
        self._force_listen = False
        self._speech_end = SpeechEnd()

    def push(self, samples: np.ndarray, rate: int) -> None:
        pieces = len(self._held)
        super().push(samples, rate)
        for piece in self._held[pieces:]:
            self._speech_end.feed(piece)
        excess = self._held_n - int(MAX_BACKLOG_S * UNIT_RATE)
        if excess > 0:
            self._take(excess)
            self.dropped_s += excess / UNIT_RATE

    def start(self, bounds: tuple[int, int] | None, now: float, short_units: bool = False) -> None:
        # The session's clock starts now: what the client sent while it waited for a
        # worker goes first, in whole units, before any silence is filled in.
        super().start(bounds, now, short_units)
        self._sent_at = now

    def sent(self, seq: int, now: float) -> None:
        self._in_flight = seq

    def answered(self, out: ev.Output) -> None:
        if self._in_flight and (out.seq >= self._in_flight or self._in_flight in out.dropped_seqs):
            self._in_flight = 0

    def end_turn(self) -> list[ev.AppendCommand]:
        """The next unit goes at once, with what was sent so far, and ends the turn."""
        self._force_listen = True
        return []

    def due(self, now: float, clock: bool) -> list[ev.AppendCommand]:
        """A whole unit of the client's audio once the last unit was answered, or what
        came when speech stopped in it (as long as the worker takes so short a unit); on
        the clock, what came (or silence) once a unit's time passed without one; after
        end_turn, at once."""
        if not self.started or self.closed:
            return []
        unit = unit_length(self.bounds)
        unit_s = unit / UNIT_RATE
        if self._in_flight and now - self._sent_at < IN_FLIGHT_UNITS * unit_s:
            return []
        # A short unit only where the engine takes it as it comes: re-chunked, it would
        # wait for the next one, and the model's units after it would be late by as much.
        fewest = self.bounds[0] if self.bounds and self.short_units else unit
        if self._held_n >= unit:
            heard = self._take(unit)
        elif not self._force_listen and self._held_n >= fewest and self._speech_end.cut_due:
            self._speech_end.cut()
            self._sent_at = now
            return [ev.AppendCommand(pcm=_pcm_bytes(self._take_all()))]
        elif self._force_listen or (clock and now - self._sent_at >= unit_s + FILL_GRACE_S):
            heard = self._take_all()
        else:
            return []
        if heard.size < unit:
            heard = np.concatenate([heard, np.zeros(unit - heard.size, np.float32)])
        self._sent_at = now
        force, self._force_listen = self._force_listen, False
        return [ev.AppendCommand(pcm=_pcm_bytes(heard[:unit]), force_listen=force)]


def for_traits(kind: str | None) -> Cadence | None:
    """The cadence a dialect names (CUT, PACED), or None: its client sends whole units."""
    if kind == CUT:
        return CutCadence()
    if kind == PACED:
        return PacedCadence()
    if kind is None:
        return None
    raise ValueError(f"unknown cadence {kind!r}")
