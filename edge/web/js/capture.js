// The microphone as 16 kHz mono float32: getUserMedia (echo cancellation, noise
// suppression, automatic gain) -> the "capture-16k" AudioWorklet -> 100 ms chunks, which
// UnitAssembler turns into the protocol's 1 s units (cut short where speech stops, by
// SpeechEnd, when the server takes units as they come).

/** Sample rate of everything the server takes as input. */
export const INPUT_RATE = 16000;
/** One unit of duplex input: exactly 1 s. */
export const UNIT_SAMPLES = INPUT_RATE;

/** Joins chunks of any length into units of exactly `size` samples. */
export class UnitAssembler {
  constructor(size = UNIT_SAMPLES, onUnit = () => {}) {
    this.size = size;
    this.onUnit = onUnit;
    this.unit = new Float32Array(size);
    this.filled = 0;
  }

  /** Add samples; calls onUnit(Float32Array) for every unit they complete. */
  push(samples) {
    let offset = 0;
    while (offset < samples.length) {
      const take = Math.min(this.size - this.filled, samples.length - offset);
      this.unit.set(samples.subarray(offset, offset + take), this.filled);
      this.filled += take;
      offset += take;
      if (this.filled === this.size) {
        const full = this.unit;
        this.unit = new Float32Array(this.size);
        this.filled = 0;
        this.onUnit(full);
      }
    }
  }

  /**
   * Send what is held now as a shorter unit (calls onUnit) when it has at least `fewest`
   * samples; returns whether it did.
   */
  flush(fewest) {
    if (this.filled === 0 || this.filled < fewest) return false;
    const part = this.unit.slice(0, this.filled);
    this.filled = 0;
    this.onUnit(part);
    return true;
  }

  /** Forget a partly filled unit (e.g. audio captured before the session started). */
  reset() {
    this.filled = 0;
  }
}

/**
 * The edge's end-of-speech rule (edge/cadence.py, SpeechEnd: its constants, the one owner):
 * 20 ms frames are speech when louder than SPEECH_RMS, quiet when under QUIET_SHARE of the
 * loudest speech frame since the last cut; CUT_QUIET_S of quiet after speech makes a cut due,
 * NEXT_CUT_QUIET_S more a second one.
 */
export const SPEECH_END = Object.freeze({
  FRAME: 320,
  SPEECH_RMS: 0.01,
  QUIET_SHARE: 0.1,
  CUT_QUIET_S: 0.2,
  NEXT_CUT_QUIET_S: 0.3,
  CUTS: 2,
});

/**
 * Where speech stops in the microphone's 16 kHz stream, by loudness alone, so the page can
 * send the end of a question at once instead of when its second is up (only where the
 * server takes units as they come: session.created's `input_units.as_sent`).
 */
export class SpeechEnd {
  constructor() {
    this.rest = new Float32Array(0);
    this.peak = 0;
    this.quiet = 0; // samples of quiet at the end of the stream (whole frames)
    this.cutsLeft = 0; // cuts still due since speech was last heard
  }

  /** Follow more of the stream (float32, 16 kHz). */
  feed(samples) {
    const { FRAME, SPEECH_RMS, QUIET_SHARE, CUTS } = SPEECH_END;
    const x = new Float32Array(this.rest.length + samples.length);
    x.set(this.rest);
    x.set(samples, this.rest.length);
    const whole = x.length - (x.length % FRAME);
    this.rest = x.slice(whole);
    const frames = whole / FRAME;
    const power = new Float64Array(frames);
    let lastLoud = -1;
    for (let f = 0; f < frames; f++) {
      let sum = 0;
      for (let i = f * FRAME; i < (f + 1) * FRAME; i++) sum += x[i] * x[i];
      power[f] = sum;
      if (sum > FRAME * SPEECH_RMS * SPEECH_RMS) {
        lastLoud = f;
        this.peak = Math.max(this.peak, sum);
      }
    }
    if (lastLoud >= 0) {
      this.quiet = 0;
      this.cutsLeft = CUTS;
    }
    // The frames after the last loud one: quiet ones add up, one in between starts over.
    let lastNoisy = -1;
    for (let f = lastLoud + 1; f < frames; f++) {
      if (power[f] >= QUIET_SHARE * QUIET_SHARE * this.peak) lastNoisy = f;
    }
    if (lastNoisy >= 0) this.quiet = (frames - lastNoisy - 1) * FRAME;
    else this.quiet += (frames - lastLoud - 1) * FRAME;
  }

  /** Whether what is held should go now. */
  get cutDue() {
    const wait = this.cutsLeft === SPEECH_END.CUTS ? SPEECH_END.CUT_QUIET_S : SPEECH_END.NEXT_CUT_QUIET_S;
    return this.cutsLeft > 0 && this.quiet >= wait * INPUT_RATE;
  }

  /** The held audio went: the next cut waits for NEXT_CUT_QUIET_S of quiet more. */
  cut() {
    this.cutsLeft -= 1;
    this.quiet = 0;
    if (!this.cutsLeft) this.peak = 0;
  }
}

/** Why the microphone is unavailable before asking for it, or null. */
export function microphoneProblem() {
  if (!window.isSecureContext) {
    return Object.assign(new Error('not a secure context'), { name: 'InsecureContext' });
  }
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return Object.assign(new Error('this browser has no getUserMedia'), { name: 'NotSupportedError' });
  }
  if (typeof AudioWorkletNode === 'undefined') {
    return Object.assign(new Error('this browser has no AudioWorklet'), { name: 'NotSupportedError' });
  }
  return null;
}

/** The tries, and the pause before each retry in ms, for a microphone that would not start. */
const OPEN_RETRIES_MS = [300, 1000];

/**
 * getUserMedia for the microphone. A device that is busy or slow to start (NotReadableError,
 * AbortError: another tab or program releasing it, the audio service starting) often opens
 * a moment later, so those are tried again after a pause; any other error, or the last
 * try's, is thrown as it came. `cancelled()` ends the waiting early (the caller checks it).
 */
async function openMicrophone(cancelled) {
  const constraints = {
    audio: {
      echoCancellation: true,
      noiseSuppression: true,
      autoGainControl: true,
      channelCount: 1,
    },
  };
  for (let attempt = 0; ; attempt += 1) {
    try {
      return await navigator.mediaDevices.getUserMedia(constraints);
    } catch (err) {
      const transient = err && (err.name === 'NotReadableError' || err.name === 'AbortError');
      if (!transient || attempt >= OPEN_RETRIES_MS.length || cancelled()) throw err;
      console.warn(`microphone did not start (${err.name}: ${err.message}); trying again`);
      await new Promise((resolve) => setTimeout(resolve, OPEN_RETRIES_MS[attempt]));
    }
  }
}

/**
 * The microphone, resampled to 16 kHz in an AudioWorklet.
 *
 * `onChunk(Float32Array)` receives every ~100 ms of audio, in order. `start()` rejects
 * with the getUserMedia error (NotAllowedError, NotFoundError, ...) so the page can say
 * what went wrong; `stop()` releases the device and may be called at any time.
 */
export class MicCapture {
  constructor({ onChunk = () => {} } = {}) {
    this.onChunk = onChunk;
    this.stream = null;
    this.context = null;
    this.node = null;
    this.source = null;
    this.level = 0; // RMS of the latest chunk, 0..1
  }

  /**
   * Ask for the microphone and start capturing. Resolves true once audio flows, false
   * when stop() was called meanwhile.
   */
  async start() {
    const problem = microphoneProblem();
    if (problem) throw problem;
    // The context is created first, inside the user's click, so autoplay rules allow it.
    const context = new AudioContext();
    this.context = context;
    const cancelled = () => this.context !== context;
    try {
      const stream = await openMicrophone(cancelled);
      if (cancelled()) {
        for (const track of stream.getTracks()) track.stop();
        return false;
      }
      this.stream = stream;
      await context.audioWorklet.addModule(new URL('./capture-worklet.js', import.meta.url));
      if (cancelled()) return false;
      this.source = context.createMediaStreamSource(stream);
      this.node = new AudioWorkletNode(context, 'capture-16k', {
        numberOfInputs: 1,
        numberOfOutputs: 1,
        outputChannelCount: [1],
        processorOptions: { outRate: INPUT_RATE },
      });
      this.node.port.onmessage = (event) => this._chunk(event.data);
      this.source.connect(this.node);
      // The node writes silence; connecting it to the speakers keeps the graph pulled
      // on every browser.
      this.node.connect(context.destination);
      if (context.state !== 'running') await context.resume();
      return !cancelled();
    } catch (err) {
      if (!cancelled()) this.stop(); // else stop() already released everything
      throw err;
    }
  }

  /** The context's rate the worklet resamples from (null before start). */
  get inputRate() {
    return this.context ? this.context.sampleRate : null;
  }

  /** Stop capturing and release the microphone. */
  stop() {
    if (this.node) {
      this.node.port.postMessage('stop');
      this.node.port.onmessage = null;
      this.node.disconnect();
      this.node = null;
    }
    if (this.source) {
      this.source.disconnect();
      this.source = null;
    }
    if (this.stream) {
      for (const track of this.stream.getTracks()) track.stop();
      this.stream = null;
    }
    if (this.context) {
      this.context.close().catch(() => {});
      this.context = null;
    }
    this.level = 0;
  }

  _chunk(samples) {
    if (!(samples instanceof Float32Array)) return;
    let sum = 0;
    for (let i = 0; i < samples.length; i++) sum += samples[i] * samples[i];
    this.level = Math.sqrt(sum / Math.max(1, samples.length));
    this.onChunk(samples);
  }
}
