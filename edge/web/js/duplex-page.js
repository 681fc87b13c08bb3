// The full-duplex page (audio.html and video.html): microphone (and camera) in, one
// `input.append` per second (a shorter one where speech stops, when the server takes units
// as they come); the model's text as captions and its audio through the jitter-buffered
// player. Everything the page knows is mirrored in `window.omni`.
//
// Protocol (current dialect, /v1/realtime?mode=audio|video):
//   <- session.queued / session.queue_update (while waiting)   <- session.queue_done
//   -> session.init {payload: {config: {speech_cuts: true}}}    <- session.created {input_units?}
//   -> input.append {input: {audio, video_frames?, force_listen?}}   every second, or sooner
//      where speech stopped (input_units.as_sent: at least input_units.min_samples)
//   <- response.output.delta kind text | audio | listen         (any time)
//   -> session.close {reason}                                   <- session.closed {reason}

import { Camera } from './camera.js';
import { INPUT_RATE, MicCapture, SpeechEnd, UNIT_SAMPLES, UnitAssembler } from './capture.js';
import { ERROR_TEXTS, closedText, errorText, mediaErrorText, socketCloseText } from './messages.js';
import { Player } from './player.js';
import { RealtimeClient, bindApiKeyField, bytesToBase64, decodeFloat32, encodeFloat32, saveApiKey } from './realtime.js';
import { appendItem, byId, enable, formatNumber, formatSeconds, guarded, setText, show } from './ui.js';

/** Session time limits, counted from session.created (the server enforces them). */
export const SESSION_LIMIT_S = { audio: 600, video: 300 };
/** The model's fixed context, tokens. */
export const KV_MAX = 8192;
/** Rows of the timings table; metrics objects kept in window.omni.timings. */
const TIMINGS_SHOWN = 10;
const TIMINGS_KEPT = 1000;
/**
 * Bytes the browser may hold unsent before a unit is skipped: about four units of JSON.
 * Past it the link is slower than real time, and the server prefers the newest unit anyway.
 */
const MAX_BUFFERED_BYTES = 4 * 90000;
/** Error codes the server ends the session after (README "Errors" table). */
const FATAL_ERRORS = new Set([
  'inference_error',
  'queue_full',
  'service_unavailable',
  'worker_busy',
  'worker_connect_failed',
  'slow_client',
]);
/** How long to wait for session.closed after session.close before dropping the socket. */
const CLOSE_WAIT_MS = 5000;

/** The page's state object, `window.omni` (docs/clients.md), fresh for one session. */
function freshState(mode) {
  return {
    mode,
    state: 'idle', // idle | connecting | queued | active | closed
    phase: null, // listening | speaking | null
    sessionId: null,
    queue: null, // {position, eta_s} while queued
    captions: '',
    unitsSent: 0,
    secondsSent: 0,
    unitsCut: 0, // sent short where speech stopped
    cutsSpeech: false, // the server takes units as they come: the page cuts at speech ends
    unitsAnswered: 0,
    unitsSkipped: 0, // not sent: the connection could not keep up
    audioSamplesReceived: 0,
    audioSamplesPlayed: 0,
    audioSamplesFlushed: 0,
    framesSent: 0,
    kvCacheLength: 0,
    kvMax: KV_MAX,
    timeLeftS: null,
    errors: [],
    closeReason: null,
    reconnecting: false,
    resumes: 0,
    timings: [],
  };
}

/** Start the page for `mode` ("audio" or "video"); returns the controller. */
export function startDuplexPage({ mode }) {
  const page = new DuplexPage(mode);
  page.bind();
  return page;
}

class DuplexPage {
  constructor(mode) {
    this.mode = mode;
    this.withVideo = mode === 'video';
    this.limitS = SESSION_LIMIT_S[mode];
    this.omni = freshState(mode);
    window.omni = this.omni;
    this.el = {
      start: byId('start'),
      stop: byId('stop'),
      interrupt: byId('interrupt'),
      apikey: byId('apikey'),
      prompt: byId('prompt'),
      status: byId('status'),
      detail: byId('close-detail'),
      queue: byId('queue'),
      phase: byId('phase'),
      timeLeft: byId('time-left'),
      context: byId('context'),
      contextText: byId('context-text'),
      level: byId('mic-level'),
      captions: byId('captions'),
      stats: byId('stats'),
      errors: byId('errors'),
      timingsToggle: byId('timings-toggle'),
      timings: byId('timings'),
      timingsBody: byId('timings-body'),
      preview: byId('preview'),
    };
    this.client = null;
    this.mic = null;
    this.camera = null;
    this.player = null;
    this.assembler = new UnitAssembler(UNIT_SAMPLES, (unit) => this._unitReady(unit));
    this.speechEnd = null; // where the server takes units as they come: cuts at speech ends
    this.fewestSamples = UNIT_SAMPLES;
    this.sendChain = Promise.resolve();
    this.ticker = null;
    this.closeTimer = null;
    this.createdAt = 0;
    this.stopping = false;
    this.forceListen = false; // set by Interrupt, sent with the next unit
    this.muted = false; // after Interrupt: audio still in flight is not played
    this.mutedSamples = 0;
    this.fatalError = null; // an error the server ends the session after
    this.lastSeq = null;
    this.lastSpeechInput = null;
    this.caption = null; // the <p> of the model's current turn
  }

  bind() {
    const report = (err) => this._pageFailure(err);
    bindApiKeyField(this.el.apikey);
    this.el.start?.addEventListener('click', guarded(() => this.start(), report));
    this.el.stop?.addEventListener('click', guarded(() => this.stop(), report));
    this.el.interrupt?.addEventListener('click', guarded(() => this.interrupt(), report));
    this.el.timingsToggle?.addEventListener('click', guarded(() => this._toggleTimings(), report));
    // Leaving the page ends the session properly instead of leaving it to time out.
    window.addEventListener('pagehide', guarded(() => this._leave(), report));
    this._render();
    this._status('Press Start and allow the microphone' + (this.withVideo ? ' and camera' : '') + ' to talk to the model.');
  }

  // ---- user actions ------------------------------------------------------------------

  /** Start: microphone (and camera) first, then the connection. */
  async start() {
    if (this._running()) return;
    this.client = null; // a previous connection may still be closing: it is ignored now
    Object.assign(this.omni, freshState(this.mode));
    this._resetView();
    this.omni.state = 'connecting';
    this.stopping = false;
    this.forceListen = false;
    this.muted = false;
    this.mutedSamples = 0;
    this.fatalError = null;
    this.lastSeq = null;
    this.lastSpeechInput = null;
    this._render();

    // Audio output must be unlocked inside the click, before any await.
    if (this.player) this.player.close();
    this.player = new Player();
    this.player.unlock();

    this._status(this.withVideo ? 'Starting the microphone and camera…' : 'Starting the microphone…');
    const mic = new MicCapture({ onChunk: (chunk) => this._captured(chunk) });
    this.mic = mic;
    try {
      if (!(await mic.start())) return; // Stop was pressed meanwhile
    } catch (err) {
      if (this.mic === mic) this._startFailed('microphone_unavailable', mediaErrorText(err, 'microphone'));
      return;
    }
    if (this.mic !== mic) return;
    this._startTicker();
    if (this.withVideo) {
      const camera = new Camera(this.el.preview);
      this.camera = camera;
      try {
        await camera.start();
      } catch (err) {
        if (this.camera === camera) this._startFailed('camera_unavailable', mediaErrorText(err, 'camera'));
        else camera.stop();
        return;
      }
      if (this.camera !== camera) {
        camera.stop(); // Stop was pressed while the camera started
        return;
      }
    }
    if (this.omni.state !== 'connecting' || this.stopping) return;
    this._connect();
  }

  /** Stop: session.close, then wait for session.closed (the socket is dropped if it never comes). */
  stop() {
    this._releaseDevices();
    if (this.player) this.player.flush();
    this._syncAudioCounts();
    if (!this.client) {
      // Still asking for the devices: nothing was opened on the server.
      if (this._running()) {
        this.omni.closeReason = 'user_stop';
        this._finish(closedText('user_stop'));
      }
      return;
    }
    if (this.stopping) return;
    this.stopping = true;
    if (this.client.close('user_stop')) {
      this._status('Ending the session…');
      this.closeTimer = setTimeout(() => this.client && this.client.abort(1000, 'no session.closed'), CLOSE_WAIT_MS);
    } else {
      this.client.abort(1000, 'user_stop'); // not open yet: just drop the attempt
    }
    this._render();
  }

  /** Interrupt: stop the model's speech now; the next unit carries force_listen. */
  interrupt() {
    if (this.omni.state !== 'active') return;
    this.forceListen = true;
    this.muted = true; // audio of units already in flight is not played either
    if (this.player) this.player.flush();
    this._syncAudioCounts();
    this.omni.phase = 'listening';
    this._render();
  }

  // ---- connection --------------------------------------------------------------------

  _connect() {
    const apiKey = this.el.apikey ? this.el.apikey.value.trim() : '';
    saveApiKey(apiKey);
    const report = (err) => this._pageFailure(err);
    // Events of an earlier connection (still closing after its session ended) are ignored.
    const client = new RealtimeClient({
      mode: this.mode,
      apiKey,
      onEvent: guarded((event) => client === this.client && this._onEvent(event), report),
      onClose: guarded((info) => client === this.client && this._onClose(info), report),
      onReconnecting: guarded((info) => client === this.client && this._reconnecting(info), report),
    });
    try {
      client.connect();
      this.client = client;
    } catch (err) {
      // The browser refused the URL or a subprotocol (a key with characters like spaces).
      const text = apiKey
        ? 'The browser refused the API key: it may contain characters (spaces, "/", "=") that cannot be sent this way.'
        : `The browser could not open the connection (${err.message}).`;
      this._startFailed('connect_failed', text);
      return;
    }
    this._status('Connecting to the server…');
  }

  _onEvent(event) {
    switch (event.type) {
      case 'session.queued':
      case 'session.queue_update':
        this.omni.state = 'queued';
        this.omni.queue = { position: event.position, eta_s: event.estimated_wait_s };
        this._status('Waiting for a free model…');
        break;
      case 'session.queue_done':
        this.omni.queue = null;
        if (this.omni.state === 'queued') this.omni.state = 'connecting';
        if (!this.stopping) {
          this.client.init(this._initPayload());
          this._status('Starting the session…');
        }
        break;
      case 'session.created':
        this._created(event);
        break;
      case 'session.resumed':
        this.omni.reconnecting = false;
        this.omni.resumes = (this.omni.resumes || 0) + 1;
        this._status('Reconnected: the conversation goes on.');
        break;
      case 'response.output.delta':
        this._delta(event);
        break;
      case 'error':
        this._serverError(event.error || {});
        break;
      case 'session.closed':
        this.omni.closeReason = typeof event.reason === 'string' ? event.reason : 'unknown';
        this._finish(closedText(this.omni.closeReason, event.message));
        break;
      default:
        break; // events of later protocol versions are ignored
    }
    this._render();
  }

  _initPayload() {
    const prompt = this.el.prompt ? this.el.prompt.value.trim() : '';
    // The page cuts a unit short where speech stops when the server takes units as they
    // come (session.created says); the engine then waits for that cut to begin a reply.
    const payload = { config: { speech_cuts: true } };
    if (prompt) payload.system_prompt = prompt;
    return payload;
  }

  _created(event) {
    if (this.stopping) return;
    this.omni.state = 'active';
    this.omni.sessionId = event.session_id || null;
    this.omni.phase = 'listening';
    const kv = event.metrics && event.metrics.kv_cache_length;
    if (typeof kv === 'number') this.omni.kvCacheLength = kv;
    this.createdAt = performance.now();
    this.omni.timeLeftS = this.limitS;
    // Audio captured while waiting is stale: the first unit starts now.
    this.assembler.reset();
    const units = event.input_units;
    const fewest = units && units.as_sent === true ? units.min_samples : null;
    if (Number.isInteger(fewest) && fewest > 0 && fewest < UNIT_SAMPLES) {
      this.speechEnd = new SpeechEnd();
      this.fewestSamples = fewest;
    } else {
      this.speechEnd = null;
    }
    this.omni.cutsSpeech = this.speechEnd !== null;
    this._status(this.withVideo ? 'Connected: talk and show things to the model.' : 'Connected: talk to the model.');
  }

  _delta(event) {
    const metrics = event.metrics || {};
    if (typeof metrics.seq === 'number' && metrics.seq !== this.lastSeq) {
      // A unit's text, audio and listen deltas share its metrics: count the unit once.
      this.lastSeq = metrics.seq;
      this.omni.unitsAnswered += 1;
      this.omni.timings.push(metrics);
      if (this.omni.timings.length > TIMINGS_KEPT) this.omni.timings.shift();
      this._renderTimings();
    }
    if (typeof metrics.kv_cache_length === 'number') this.omni.kvCacheLength = metrics.kv_cache_length;

    if (event.kind === 'text') {
      if (typeof event.text === 'string' && event.text) {
        this._speaking(event);
        this.omni.captions += event.text;
        this._caption(event.text);
      }
    } else if (event.kind === 'audio') {
      this._speaking(event);
      let samples;
      try {
        samples = decodeFloat32(event.audio || '');
      } catch {
        this._serverError({ code: 'invalid_audio', message: 'the server sent audio that is not base64' });
        return;
      }
      this.omni.audioSamplesReceived += samples.length;
      if (this.muted) this.mutedSamples += samples.length;
      else this.player.enqueue(samples);
      this._syncAudioCounts();
    } else if (event.kind === 'listen') {
      this._listening(event);
    }
  }

  /** A text or audio delta: the model speaks (unless the user just interrupted it). */
  _speaking(event) {
    this.lastSpeechInput = event.input_id;
    if (this.muted) return;
    if (this.omni.phase !== 'speaking') {
      this.omni.phase = 'speaking';
      this.caption = null; // a new turn starts a new caption paragraph
    }
  }

  /**
   * A listen delta. After the last unit of a turn the server sends one for that same unit:
   * the turn ended normally and its last audio plays out. A listen for a later unit while
   * the model was speaking means it was cut off (the user spoke, or force_listen):
   * queued playback is dropped.
   */
  _listening(event) {
    this.muted = false;
    if (this.omni.phase === 'speaking' && event.input_id !== this.lastSpeechInput) {
      this.player.flush();
      this._syncAudioCounts();
    }
    this.omni.phase = 'listening';
  }

  _serverError(error) {
    const code = typeof error.code === 'string' ? error.code : 'unknown';
    const message = typeof error.message === 'string' ? error.message : '';
    this.omni.errors.push({ code, message });
    if (FATAL_ERRORS.has(code)) this.fatalError = { code, message };
    const text = errorText(code, message);
    appendItem(this.el.errors, text);
    this._status(text, 'error');
  }

  /** The connection dropped: the client resumes the session by itself meanwhile. */
  _reconnecting({ attempt }) {
    this.omni.reconnecting = true;
    this._status(attempt > 1 ? `Reconnecting… (attempt ${attempt})` : 'Connection lost: reconnecting…');
    this._render();
  }

  _onClose({ code, reason }) {
    const detail = `Connection closed: code ${code}${reason ? `, "${reason}"` : ''}.`;
    if (this.omni.state !== 'closed') {
      if (this.stopping) {
        // Stopped before the session was set up, or session.closed never came.
        this.omni.closeReason = 'user_stop';
        this._finish(closedText('user_stop'));
      } else {
        // The socket ended without session.closed: its close code and reason say why.
        this.omni.closeReason = reason || `close_${code}`;
        this._finish(socketCloseText(code, reason));
      }
    }
    setText(this.el.detail, detail);
    clearTimeout(this.closeTimer);
    this.client = null;
    this._render();
  }

  /** The session is over (session.closed or the socket's end). */
  _finish(text) {
    this.omni.state = 'closed';
    this.omni.phase = null;
    this.omni.queue = null;
    this.stopping = false;
    clearTimeout(this.closeTimer);
    this._releaseDevices();
    this._stopTicker();
    let full = text;
    const fatal = this.fatalError;
    if (fatal) {
      // The error that ended the session explains it best; the close adds what is new.
      const lead = errorText(fatal.code, fatal.message);
      full = text === ERROR_TEXTS[fatal.code] ? lead : `${lead} ${text}`;
    }
    const byUser = ['user_stop', 'stopped'].includes(this.omni.closeReason);
    this._status(full, byUser && !fatal ? 'info' : 'error');
    this._render();
  }

  _leave() {
    if (this.client && this._running()) this.client.close('client_closed');
    this._releaseDevices();
    if (this.player) this.player.close();
  }

  // ---- capture -----------------------------------------------------------------------

  _captured(chunk) {
    if (this.omni.state !== 'active' || this.stopping) return;
    this.assembler.push(chunk);
    const end = this.speechEnd;
    if (!end) return;
    end.feed(chunk);
    // As the edge's paced cadence does: what came goes once speech stopped, if the server
    // takes so short a unit (else it waits for more quiet); not with an Interrupt pending.
    if (end.cutDue && !this.forceListen && this.assembler.flush(this.fewestSamples)) {
      end.cut();
      this.omni.unitsCut += 1;
    }
  }

  _unitReady(unit) {
    // Units go out in order even though a video frame is encoded asynchronously.
    this.sendChain = this.sendChain
      .then(() => this._sendUnit(unit))
      .catch((err) => this._pageFailure(err));
  }

  async _sendUnit(unit) {
    if (!this.client || this.omni.state !== 'active' || this.stopping) return;
    if (this.client.bufferedAmount > MAX_BUFFERED_BYTES) {
      this.omni.unitsSkipped += 1;
      return;
    }
    const input = { audio: encodeFloat32(unit) };
    let frame = null;
    if (this.camera) {
      frame = await this.camera.grabJpeg().catch(() => null);
      if (frame) input.video_frames = [bytesToBase64(frame)];
    }
    if (this.forceListen) input.force_listen = true;
    if (!this.client || this.omni.state !== 'active' || this.stopping) return;
    if (this.client.append(input)) {
      this.forceListen = false;
      this.omni.unitsSent += 1;
      this.omni.secondsSent += unit.length / INPUT_RATE;
      if (frame) this.omni.framesSent += 1;
      this._render();
    }
  }

  _releaseDevices() {
    if (this.mic) {
      this.mic.stop();
      this.mic = null;
    }
    if (this.camera) {
      this.camera.stop();
      this.camera = null;
    }
    this.assembler.reset();
  }

  /** The microphone, camera or connection could not start: report it and go back to idle. */
  _startFailed(code, text) {
    this.omni.errors.push({ code, message: text });
    this._releaseDevices();
    this._stopTicker();
    if (this.player) this.player.close();
    this.player = null;
    this.omni.state = 'idle';
    appendItem(this.el.errors, text);
    this._status(text, 'error');
    this._render();
  }

  /** A bug in the page itself: shown, recorded, never thrown at the browser. */
  _pageFailure(err) {
    const message = err && err.message ? err.message : String(err);
    this.omni.errors.push({ code: 'page_error', message });
    appendItem(this.el.errors, `Page error: ${message}`);
    console.error(err);
  }

  // ---- view --------------------------------------------------------------------------

  _running() {
    return ['connecting', 'queued', 'active'].includes(this.omni.state);
  }

  _syncAudioCounts() {
    if (!this.player) return;
    this.omni.audioSamplesPlayed = this.player.samplesPlayed;
    this.omni.audioSamplesFlushed = this.player.samplesFlushed + this.mutedSamples;
  }

  /** Four times a second: time left and the microphone level. */
  _startTicker() {
    this._stopTicker();
    this.ticker = setInterval(guarded(() => this._tick(), (err) => this._pageFailure(err)), 250);
  }

  _stopTicker() {
    clearInterval(this.ticker);
    this.ticker = null;
    if (this.el.level) this.el.level.value = 0;
  }

  _tick() {
    if (this.omni.state === 'active') {
      const elapsed = (performance.now() - this.createdAt) / 1000;
      this.omni.timeLeftS = Math.max(0, Math.ceil(this.limitS - elapsed));
    }
    // Speech sits around 0.01-0.2 RMS: scaled so normal speech fills most of the meter.
    if (this.el.level && this.mic) this.el.level.value = Math.min(1, this.mic.level * 5);
    this._render();
  }

  _status(text, kind = 'info') {
    setText(this.el.status, text);
    if (this.el.status) this.el.status.dataset.kind = kind;
  }

  _caption(text) {
    if (!this.el.captions) return;
    if (!this.caption) {
      this.caption = document.createElement('p');
      this.el.captions.appendChild(this.caption);
    }
    this.caption.textContent += text;
    this.el.captions.scrollTop = this.el.captions.scrollHeight;
  }

  _resetView() {
    if (this.el.captions) this.el.captions.textContent = '';
    this.caption = null;
    if (this.el.errors) this.el.errors.textContent = '';
    setText(this.el.detail, '');
    this._renderTimings();
  }

  _render() {
    const o = this.omni;
    const running = this._running();
    enable(this.el.start, !running);
    enable(this.el.stop, running && !this.stopping);
    enable(this.el.interrupt, o.state === 'active' && !this.stopping);
    enable(this.el.apikey, !running);
    enable(this.el.prompt, !running);

    if (o.queue) {
      const eta = typeof o.queue.eta_s === 'number' ? `, about ${formatSeconds(o.queue.eta_s)} to wait` : '';
      setText(this.el.queue, `Waiting in line: position ${o.queue.position}${eta}.`);
    }
    show(this.el.queue, Boolean(o.queue));

    if (this.el.phase) {
      this.el.phase.dataset.phase = o.phase || 'none';
      this.el.phase.textContent = o.phase === 'speaking' ? 'Model speaking' : o.phase === 'listening' ? 'Model listening' : 'Not connected';
    }
    setText(this.el.timeLeft, o.state === 'active' && o.timeLeftS !== null ? formatSeconds(o.timeLeftS) : '–');
    if (this.el.context) {
      this.el.context.max = o.kvMax;
      this.el.context.value = Math.min(o.kvCacheLength, o.kvMax);
    }
    const share = Math.round((100 * o.kvCacheLength) / o.kvMax);
    setText(this.el.contextText, `${o.kvCacheLength} / ${o.kvMax} tokens (${share}%)`);
    const seconds = (n) => formatNumber(n / 24000, 1);
    const frames = this.withVideo ? `, ${o.framesSent} frames` : '';
    const skipped = o.unitsSkipped ? `, ${o.unitsSkipped} skipped (slow connection)` : '';
    setText(
      this.el.stats,
      `Sent ${formatNumber(o.secondsSent, 1)} s of audio${frames}${skipped}; ${o.unitsAnswered} answered; ` +
        `model audio ${seconds(o.audioSamplesReceived)} s received, ${seconds(o.audioSamplesPlayed)} s played.`,
    );
  }

  _toggleTimings() {
    const table = this.el.timings;
    if (!table) return;
    table.hidden = !table.hidden;
    const open = !table.hidden;
    this.el.timingsToggle.setAttribute('aria-expanded', String(open));
    this.el.timingsToggle.textContent = open ? 'Hide timings' : 'Show timings';
    this._renderTimings();
  }

  _renderTimings() {
    const body = this.el.timingsBody;
    if (!body || (this.el.timings && this.el.timings.hidden)) return;
    body.textContent = '';
    const rows = this.omni.timings.slice(-TIMINGS_SHOWN).reverse();
    for (const m of rows) {
      const tr = document.createElement('tr');
      const cells = [
        m.seq,
        m.kv_cache_length,
        formatNumber(m.prefill_ms),
        formatNumber(m.generate_ms),
        formatNumber(m.wall_clock_ms),
        m.n_tokens,
        m.n_tts_tokens,
        Array.isArray(m.dropped_seqs) ? m.dropped_seqs.join(' ') : '',
      ];
      for (const value of cells) {
        const td = document.createElement('td');
        td.textContent = value === undefined || value === null ? '' : String(value);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }
}
