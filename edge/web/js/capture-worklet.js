// AudioWorklet processor "capture-16k": microphone input at the context's rate (often
// 48 kHz) -> mono 16 kHz float32, posted to the main thread in 100 ms chunks.
//
// Resampling is band-limited: each output sample is a windowed-sinc low-pass of the input
// around its (fractional) position, so content above 8 kHz is removed instead of folding
// back into the speech band as plain decimation would. Works for any ratio (48000,
// 44100, 96000 -> 16000).

const DEFAULT_OUT_RATE = 16000;
const CHUNK_SECONDS = 0.1;

/** Streaming windowed-sinc resampler with a precomputed table of fractional phases. */
class Resampler {
  constructor(inRate, outRate, zeroCrossings = 10, phases = 128) {
    this.step = inRate / outRate; // input samples per output sample
    // Cutoff in cycles per input sample: 90% of the lower of the two Nyquist frequencies.
    const cutoff = 0.45 * Math.min(1, outRate / inRate);
    this.half = Math.ceil(zeroCrossings / (2 * cutoff)); // taps on each side
    this.phases = phases;
    this.table = [];
    // Row p holds the taps for an output lying p/phases of a sample past an input sample.
    for (let p = 0; p <= phases; p++) {
      const frac = p / phases;
      const taps = new Float32Array(2 * this.half);
      let sum = 0;
      for (let j = 0; j < taps.length; j++) {
        const d = frac - (j - this.half + 1); // distance in input samples
        const x = 2 * cutoff * d;
        const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
        const w = d / this.half; // Blackman window over [-half, half]
        const window = Math.abs(w) >= 1 ? 0 : 0.42 + 0.5 * Math.cos(Math.PI * w) + 0.08 * Math.cos(2 * Math.PI * w);
        taps[j] = sinc * window;
        sum += taps[j];
      }
      for (let j = 0; j < taps.length; j++) taps[j] /= sum; // unity gain at 0 Hz
      this.table.push(taps);
    }
    // Input history; the first `half` samples are silence before the first real sample.
    this.buffer = new Float32Array(4096);
    this.length = this.half;
    this.pos = this.half; // input position of the next output sample
    this.out = new Float32Array(0);
  }

  /** Feed input samples; returns the output samples they completed (a reused view). */
  push(input) {
    if (this.length + input.length > this.buffer.length) {
      const bigger = new Float32Array(2 * (this.length + input.length));
      bigger.set(this.buffer.subarray(0, this.length));
      this.buffer = bigger;
    }
    this.buffer.set(input, this.length);
    this.length += input.length;

    const most = Math.ceil(input.length / this.step) + 2;
    if (this.out.length < most) this.out = new Float32Array(most);
    let n = 0;
    while (Math.floor(this.pos) + this.half < this.length) {
      const base = Math.floor(this.pos);
      const taps = this.table[Math.round((this.pos - base) * this.phases)];
      const first = base - this.half + 1;
      let acc = 0;
      for (let j = 0; j < taps.length; j++) acc += taps[j] * this.buffer[first + j];
      this.out[n++] = acc;
      this.pos += this.step;
    }
    // Keep only the history the next output still needs.
    const drop = Math.floor(this.pos) - this.half + 1;
    if (drop > 0) {
      this.buffer.copyWithin(0, drop, this.length);
      this.length -= drop;
      this.pos -= drop;
    }
    return this.out.subarray(0, n);
  }
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const outRate = (options && options.processorOptions && options.processorOptions.outRate) || DEFAULT_OUT_RATE;
    // `sampleRate` is the AudioContext's rate, a global of the worklet scope.
    this.resampler = new Resampler(sampleRate, outRate);
    this.chunkSize = Math.round(outRate * CHUNK_SECONDS);
    this.chunk = new Float32Array(this.chunkSize);
    this.filled = 0;
    this.mono = new Float32Array(128);
    this.running = true;
    this.port.onmessage = (event) => {
      if (event.data === 'stop') this.running = false;
    };
  }

  process(inputs) {
    if (!this.running) return false; // lets the browser drop the node
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true; // no input connected yet
    const frames = channels[0].length;
    if (this.mono.length !== frames) this.mono = new Float32Array(frames);
    // Average the channels: a stereo microphone becomes mono without losing either side.
    this.mono.fill(0);
    for (const channel of channels) {
      for (let i = 0; i < frames; i++) this.mono[i] += channel[i] / channels.length;
    }
    const out = this.resampler.push(this.mono);
    for (let i = 0; i < out.length; i++) {
      this.chunk[this.filled++] = out[i];
      if (this.filled === this.chunkSize) {
        // Transfer the buffer (no copy) and start a new one.
        this.port.postMessage(this.chunk, [this.chunk.buffer]);
        this.chunk = new Float32Array(this.chunkSize);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor('capture-16k', CaptureProcessor);
