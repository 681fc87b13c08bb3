// Playback of the model's 24 kHz float32 audio on its own AudioContext timeline.
//
// Each chunk becomes an AudioBufferSourceNode started exactly where the previous one
// ends, so chunks join without gaps or clicks. The jitter buffer is the lead: when
// playback starts (or has run dry) the first chunk is scheduled `leadS` ahead of the
// clock, so a chunk arriving up to that much late still joins seamlessly. flush() stops
// everything scheduled, e.g. when the model switches to listening.

/** Sample rate of all audio the server sends. */
export const OUTPUT_RATE = 24000;

/** Scheduling closer to the clock than this risks a chunk starting late (a click). */
const MIN_MARGIN_S = 0.02;

export class Player {
  constructor({ sampleRate = OUTPUT_RATE, leadS = 0.2 } = {}) {
    this.sampleRate = sampleRate;
    this.leadS = leadS;
    this.context = null;
    this.output = null;
    this.scheduled = new Set(); // {source, start, end, samples}
    this.nextTime = 0; // context time where the next chunk starts
    this.samplesReceived = 0;
    this.samplesPlayed = 0; // scheduled to the speakers
    this.samplesFlushed = 0; // scheduled, then stopped by flush() before they were heard
  }

  /**
   * Create (or resume) the AudioContext. Call it from a click handler: browsers only let
   * a page start audio in response to the user.
   */
  unlock() {
    if (!this.context) {
      this.context = new AudioContext();
      this.output = this.context.createGain();
      this.output.connect(this.context.destination);
    }
    if (this.context.state === 'suspended') this.context.resume().catch(() => {});
  }

  /** Seconds of audio scheduled and not yet heard. */
  get queuedS() {
    if (!this.context) return 0;
    return Math.max(0, this.nextTime - this.context.currentTime);
  }

  /** True while audio is scheduled or sounding. */
  get busy() {
    return this.scheduled.size > 0;
  }

  /** Schedule one chunk of samples right after what is already scheduled. */
  enqueue(samples) {
    this.samplesReceived += samples.length;
    if (samples.length === 0) return;
    this.unlock();
    const ctx = this.context;
    const now = ctx.currentTime;
    if (this.nextTime < now + MIN_MARGIN_S) {
      // Idle, or the audio ran out before this chunk came: start again with a full lead.
      this.nextTime = now + this.leadS;
    }
    const buffer = ctx.createBuffer(1, samples.length, this.sampleRate);
    buffer.copyToChannel(samples, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.output);
    const entry = { source, start: this.nextTime, end: this.nextTime + buffer.duration, samples: samples.length };
    source.onended = () => {
      this.scheduled.delete(entry);
      source.disconnect();
    };
    source.start(entry.start);
    this.scheduled.add(entry);
    this.nextTime = entry.end;
    this.samplesPlayed += samples.length;
  }

  /** Stop all scheduled audio now; returns how many samples were dropped unheard. */
  flush() {
    if (!this.context) return 0;
    const now = this.context.currentTime;
    let dropped = 0;
    for (const entry of this.scheduled) {
      const unheard = Math.min(1, Math.max(0, (entry.end - Math.max(now, entry.start)) / (entry.end - entry.start)));
      dropped += Math.round(unheard * entry.samples);
      entry.source.onended = null;
      try {
        entry.source.stop();
      } catch {
        // Already stopped: nothing to do.
      }
      entry.source.disconnect();
    }
    this.scheduled.clear();
    this.nextTime = 0;
    this.samplesFlushed += dropped;
    return dropped;
  }

  /** Stop playback and release the audio device. */
  close() {
    this.flush();
    if (this.context) {
      this.context.close().catch(() => {});
      this.context = null;
      this.output = null;
    }
  }
}
