// The microphone as 16 kHz mono float32: getUserMedia (echo cancellation, noise
// suppression, automatic gain) -> the "capture-16k" AudioWorklet -> 100 ms chunks, which
// UnitAssembler turns into the protocol's 1 s units.

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

  /** Forget a partly filled unit (e.g. audio captured before the session started). */
  reset() {
    this.filled = 0;
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
