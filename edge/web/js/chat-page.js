// The turn-based chat page (chat.html): text, a recorded question or an image in; the
// reply streams in as text, and as speech when "Speak replies" is on.
//
// Protocol (/v1/realtime?mode=chat): <- session.queue_done, -> session.init {payload: {}},
// <- session.created; then per turn -> input.append {input: {messages, streaming, tts}}
// carrying the WHOLE conversation (the server keeps no history), <- response.output.delta
// kind text | audio ..., <- response.done {text, reason, metrics}. A turn that has to wait
// for a free model is announced by session.queued / queue_update / queue_done.

import { MicCapture, INPUT_RATE } from './capture.js';
import { ERROR_TEXTS, closedText, errorText, mediaErrorText, socketCloseText } from './messages.js';
import { Player } from './player.js';
import { RealtimeClient, bindApiKeyField, bytesToBase64, decodeFloat32, encodeFloat32, saveApiKey } from './realtime.js';
import { appendItem, byId, enable, formatNumber, formatSeconds, guarded, setText, show } from './ui.js';

/** Server limits of one request (README, "Chat"): messages, audio per part, frame size. */
const MAX_MESSAGES = 64;
const MAX_RECORDING_S = 120;
const MAX_IMAGE_BYTES = 8 * 1024 * 1024;
/** Requests are kept well under the server's 16 MiB frame limit by dropping old turns. */
const MAX_REQUEST_CHARS = 12 * 1024 * 1024;
/** Errors after which the server closes the connection (the next Send reconnects). */
const FATAL_ERRORS = new Set(['queue_full', 'service_unavailable', 'worker_busy', 'worker_connect_failed', 'slow_client']);

/** Start the chat page; returns the controller. */
export function startChatPage() {
  const page = new ChatPage();
  page.bind();
  return page;
}

class ChatPage {
  constructor() {
    // The page's state object, `window.omni` (docs/clients.md), updated live.
    this.omni = {
      mode: 'chat',
      state: 'idle', // idle | connecting | ready | generating | closed
      sessionId: null,
      queue: null, // {position, eta_s} while a turn waits for a free model
      turns: [], // {user, assistant, done, attachments, reason?, metrics?, error?}
      audioSamplesReceived: 0,
      audioSamplesPlayed: 0,
      errors: [],
      closeReason: null,
    };
    window.omni = this.omni;
    this.el = {
      text: byId('text'),
      send: byId('send'),
      record: byId('record'),
      image: byId('image'),
      tts: byId('tts'),
      apikey: byId('apikey'),
      prompt: byId('prompt'),
      transcript: byId('transcript'),
      status: byId('status'),
      detail: byId('close-detail'),
      attachments: byId('attachments'),
      clear: byId('clear'),
      errors: byId('errors'),
    };
    this.client = null;
    this.created = false;
    this.player = new Player();
    this.history = []; // messages of finished turns: {role, content}
    this.outgoing = null; // {message, turn} waiting for the session to be ready
    this.inFlight = null; // {message, turn, view} being answered
    this.recorder = null;
    this.recorded = []; // 16 kHz chunks of the recording in progress
    this.recording = null; // a finished recording not sent yet: Float32Array
    this.recordTimer = null;
    this.preparing = false; // send() is reading an attachment
    this.fatal = null; // an error the server closes the connection after
  }

  bind() {
    const report = (err) => this._pageFailure(err);
    bindApiKeyField(this.el.apikey);
    this.el.send?.addEventListener('click', guarded(() => this.send(), report));
    this.el.record?.addEventListener('click', guarded(() => this.toggleRecording(), report));
    this.el.clear?.addEventListener('click', guarded(() => this.clear(), report));
    this.el.image?.addEventListener('change', guarded(() => this._renderAttachments(), report));
    this.el.text?.addEventListener(
      'keydown',
      guarded((event) => {
        // Enter sends, Shift+Enter starts a new line.
        if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
          event.preventDefault();
          return this.send();
        }
        return undefined;
      }, report),
    );
    window.addEventListener('pagehide', guarded(() => this._leave(), report));
    this._render();
    this._status('Type a message, record a question or attach an image, then press Send.');
  }

  // ---- user actions ------------------------------------------------------------------

  /** Send the text box, the recording and the chosen image as one user turn. */
  async send() {
    if (this.omni.state === 'generating' || this.outgoing || this.preparing) {
      this._status('Wait for the reply to finish before sending more.');
      return;
    }
    this.player.unlock(); // inside the click: browsers only start audio for the user
    if (this.recorder) this._stopRecording(); // Send while recording sends the recording
    this.preparing = true;
    try {
      await this._send();
    } finally {
      this.preparing = false;
      this._render();
    }
  }

  async _send() {
    const text = this.el.text ? this.el.text.value.trim() : '';
    const file = this.el.image && this.el.image.files ? this.el.image.files[0] : null;
    const audio = this.recording;
    if (!text && !file && !audio) {
      this._status('Type a message, record a question or attach an image first.');
      return;
    }
    const parts = [];
    const attachments = [];
    if (file) {
      if (file.size > MAX_IMAGE_BYTES) {
        this._localError('image_too_large', `The image is too large (${formatNumber(file.size / 1048576)} MB); the limit is 8 MB.`);
        return;
      }
      const bytes = new Uint8Array(await file.arrayBuffer());
      parts.push({ type: 'image', data: bytesToBase64(bytes) });
      attachments.push(`image ${file.name}`);
    }
    if (audio) {
      parts.push({ type: 'audio', data: encodeFloat32(audio), sample_rate: INPUT_RATE });
      attachments.push(`recording ${formatNumber(audio.length / INPUT_RATE)} s`);
    }
    if (text) parts.push({ type: 'text', text });
    // Plain text goes as a string; anything else as a list of content parts.
    const content = parts.length === 1 && text ? text : parts;

    const turn = { user: text, assistant: '', done: false, attachments };
    this.omni.turns.push(turn);
    this.outgoing = { message: { role: 'user', content }, turn, view: this._addTurnView(turn) };
    if (this.el.text) this.el.text.value = '';
    if (this.el.image) this.el.image.value = '';
    this.recording = null;
    this._renderAttachments();

    if (this.created && this.client && this.client.open) this._dispatch();
    else this._connect();
    this._render();
  }

  /** Start or stop recording; a finished recording is sent at once (with any text). */
  async toggleRecording() {
    if (this.recorder) {
      this._stopRecording();
      if (!this.recording) return;
      if (this.omni.state === 'generating' || this.outgoing) {
        this._status('Recording kept: press Send when the reply has finished.');
        return;
      }
      await this.send();
      return;
    }
    this.player.unlock();
    this.recorded = [];
    const recorder = new MicCapture({ onChunk: (chunk) => this.recorded.push(chunk) });
    this.recorder = recorder;
    this._render();
    try {
      if (!(await recorder.start())) return;
    } catch (err) {
      if (this.recorder === recorder) {
        this.recorder = null;
        this._localError('microphone_unavailable', mediaErrorText(err, 'microphone'));
      }
      return;
    }
    this._status('Recording… press the button again to send.');
    this.recordTimer = setTimeout(
      guarded(() => this.toggleRecording(), (err) => this._pageFailure(err)),
      MAX_RECORDING_S * 1000,
    );
    this._render();
  }

  /** Forget the conversation (the next message starts a new one). */
  clear() {
    if (this.omni.state === 'generating') return;
    this.history = [];
    this.omni.turns.length = 0;
    if (this.el.transcript) this.el.transcript.textContent = '';
    this.player.flush();
    this._status('New conversation.');
    this._render();
  }

  // ---- connection --------------------------------------------------------------------

  _connect() {
    if (this.client) return; // connecting already: the turn goes out once it is ready
    const apiKey = this.el.apikey ? this.el.apikey.value.trim() : '';
    saveApiKey(apiKey);
    this.created = false;
    this.omni.closeReason = null;
    this.omni.sessionId = null;
    this.omni.state = 'connecting';
    setText(this.el.detail, '');
    const client = new RealtimeClient({
      mode: 'chat',
      apiKey,
      onEvent: guarded((event) => client === this.client && this._onEvent(event), (err) => this._pageFailure(err)),
      onClose: guarded((info) => this._onClose(client, info), (err) => this._pageFailure(err)),
    });
    try {
      client.connect();
    } catch (err) {
      this.omni.state = 'closed';
      this.omni.closeReason = 'connect_failed';
      const text = apiKey
        ? 'The browser refused the API key: it may contain characters (spaces, "/", "=") that cannot be sent this way.'
        : `The browser could not open the connection (${err.message}).`;
      this._failOutgoing('connect_failed', text);
      return;
    }
    this.client = client;
    this._status('Connecting…');
  }

  _onEvent(event) {
    switch (event.type) {
      case 'session.queue_done':
        this.omni.queue = null;
        if (!this.created) {
          this.client.init({});
        } else {
          this._status('A model is free: generating the reply…');
        }
        break;
      case 'session.queued':
      case 'session.queue_update': {
        this.omni.queue = { position: event.position, eta_s: event.estimated_wait_s };
        const eta = typeof event.estimated_wait_s === 'number' ? `, about ${formatSeconds(event.estimated_wait_s)}` : '';
        this._status(`Waiting for a free model: position ${event.position}${eta}.`);
        break;
      }
      case 'session.created':
        this.created = true;
        this.omni.sessionId = event.session_id || null;
        this.omni.state = 'ready';
        if (this.outgoing) this._dispatch();
        else this._status('Connected.');
        break;
      case 'response.output.delta':
        this._delta(event);
        break;
      case 'response.done':
        this._done(event);
        break;
      case 'error':
        this._serverError(event.error || {});
        break;
      case 'session.closed':
        this.omni.closeReason = typeof event.reason === 'string' ? event.reason : 'unknown';
        this._closed(closedText(this.omni.closeReason, event.message));
        break;
      default:
        break; // events of later protocol versions are ignored
    }
    this._render();
  }

  /** Send the waiting turn with the whole conversation so far. */
  _dispatch() {
    const pending = this.outgoing;
    this.outgoing = null;
    const messages = this._requestMessages(pending.message);
    const sent = this.client.append({
      messages,
      streaming: true,
      tts: { enabled: Boolean(this.el.tts && this.el.tts.checked) },
    });
    if (!sent) {
      this._failTurn(pending, 'connection_lost', 'The connection closed before the message could be sent.');
      return;
    }
    this.inFlight = pending;
    this.omni.state = 'generating';
    this._status('Generating the reply…');
  }

  /** System prompt + history + the new message, within the server's limits. */
  _requestMessages(message) {
    const prompt = this.el.prompt ? this.el.prompt.value.trim() : '';
    const system = prompt ? [{ role: 'system', content: prompt }] : [];
    let history = this.history.slice(-(MAX_MESSAGES - 1 - system.length));
    const size = (list) => JSON.stringify(list).length;
    // Oldest turns go first when the request would be too large (images, recordings).
    while (history.length > 0 && size([...system, ...history, message]) > MAX_REQUEST_CHARS) {
      history = history.slice(2);
    }
    // The conversation must start with the user (a trimmed history may not).
    while (history.length > 0 && history[0].role !== 'user') history = history.slice(1);
    return [...system, ...history, message];
  }

  _delta(event) {
    const current = this.inFlight;
    if (!current) return;
    if (event.kind === 'text' && typeof event.text === 'string') {
      current.turn.assistant += event.text;
      setText(current.view.assistant, current.turn.assistant);
      this._scroll();
    } else if (event.kind === 'audio') {
      let samples;
      try {
        samples = decodeFloat32(event.audio || '');
      } catch {
        this._localError('invalid_audio', 'The server sent audio that is not base64.');
        return;
      }
      this.player.enqueue(samples);
      this.omni.audioSamplesReceived = this.player.samplesReceived;
      this.omni.audioSamplesPlayed = this.player.samplesPlayed;
    }
  }

  _done(event) {
    const current = this.inFlight;
    this.inFlight = null;
    this.omni.queue = null;
    if (this.omni.state === 'generating') this.omni.state = 'ready';
    if (!current) return;
    const { turn, view } = current;
    // response.done carries the whole reply: it is the reference for the history.
    if (typeof event.text === 'string') turn.assistant = event.text;
    turn.done = true;
    turn.reason = event.reason;
    turn.metrics = event.metrics || {};
    setText(view.assistant, turn.assistant);
    const summary = metricsSummary(turn.metrics, turn.reason);
    setText(view.metrics, summary);
    this.history.push(current.message, { role: 'assistant', content: turn.assistant });
    this._status(summary ? `Reply done: ${summary}` : 'Reply done.');
    this._scroll();
  }

  _serverError(error) {
    const code = typeof error.code === 'string' ? error.code : 'unknown';
    const message = typeof error.message === 'string' ? error.message : '';
    this.omni.errors.push({ code, message });
    const text = errorText(code, message);
    appendItem(this.el.errors, text);
    this._status(text, 'error');
    // A turn in progress has failed: it ends here and is not added to the history.
    if (this.inFlight) {
      this._failTurn(this.inFlight, code, text);
      this.inFlight = null;
      if (this.omni.state === 'generating') this.omni.state = 'ready';
    }
    // An error before the session exists (e.g. a refused init): the waiting turn fails.
    if (this.outgoing && !this.created) {
      this._failTurn(this.outgoing, code, text);
      this.outgoing = null;
    }
    if (FATAL_ERRORS.has(code)) this.fatal = { code, message };
  }

  _onClose(client, { code, reason }) {
    const detail = `Connection closed: code ${code}${reason ? `, "${reason}"` : ''}.`;
    if (client !== this.client) {
      // The session already ended (session.closed); a newer connection may be open.
      if (!this.client) setText(this.el.detail, detail);
      return;
    }
    this.client = null;
    this.created = false;
    setText(this.el.detail, detail);
    if (this.omni.state !== 'closed') {
      this.omni.closeReason = reason || `close_${code}`;
      this._closed(socketCloseText(code, reason));
    }
    this._render();
  }

  /** The session is over; the next Send opens a new one (the history is the page's). */
  _closed(text) {
    this.omni.state = 'closed';
    this.omni.queue = null;
    // The next Send opens a new connection; this one's last events are ignored.
    this.client = null;
    this.created = false;
    const lost = 'The connection closed before the reply was complete.';
    if (this.inFlight) this._failTurn(this.inFlight, 'connection_lost', lost);
    if (this.outgoing) this._failTurn(this.outgoing, 'connection_lost', lost);
    this.inFlight = null;
    this.outgoing = null;
    let full = text;
    if (this.fatal) {
      const lead = errorText(this.fatal.code, this.fatal.message);
      full = text === ERROR_TEXTS[this.fatal.code] ? lead : `${lead} ${text}`;
      this.fatal = null;
    }
    const byUser = ['user_stop', 'client_closed'].includes(this.omni.closeReason);
    this._status(`${full}${byUser ? '' : ' Sending again opens a new session; the conversation is kept.'}`, byUser ? 'info' : 'error');
  }

  /** Mark a turn as failed (shown under it); it stays out of the history. */
  _failTurn(pending, code, text) {
    pending.turn.done = true;
    pending.turn.error = { code, message: text };
    if (pending.view) {
      setText(pending.view.metrics, text);
      pending.view.root.dataset.failed = 'true';
    }
  }

  _failOutgoing(code, text) {
    this.omni.errors.push({ code, message: text });
    appendItem(this.el.errors, text);
    if (this.outgoing) this._failTurn(this.outgoing, code, text);
    this.outgoing = null;
    this._status(text, 'error');
    this._render();
  }

  _leave() {
    this._stopRecording();
    if (this.client) this.client.close('client_closed');
    this.player.close();
  }

  // ---- recording ---------------------------------------------------------------------

  _stopRecording() {
    clearTimeout(this.recordTimer);
    this.recordTimer = null;
    if (!this.recorder) return;
    this.recorder.stop();
    this.recorder = null;
    const total = this.recorded.reduce((n, chunk) => n + chunk.length, 0);
    if (total === 0) {
      this._status('Nothing was recorded.');
    } else {
      const samples = new Float32Array(total);
      let offset = 0;
      for (const chunk of this.recorded) {
        samples.set(chunk, offset);
        offset += chunk.length;
      }
      this.recording = samples;
    }
    this.recorded = [];
    this._renderAttachments();
    this._render();
  }

  // ---- view --------------------------------------------------------------------------

  _addTurnView(turn) {
    const root = document.createElement('div');
    root.className = 'turn';
    const user = document.createElement('div');
    user.className = 'user';
    user.textContent = turn.user;
    for (const note of turn.attachments) {
      const tag = document.createElement('span');
      tag.className = 'tag';
      tag.textContent = note;
      user.appendChild(tag);
    }
    const assistant = document.createElement('div');
    assistant.className = 'assistant';
    const metrics = document.createElement('div');
    metrics.className = 'metrics';
    root.append(user, assistant, metrics);
    this.el.transcript?.appendChild(root);
    this._scroll();
    return { root, assistant, metrics };
  }

  _scroll() {
    if (this.el.transcript) this.el.transcript.scrollTop = this.el.transcript.scrollHeight;
  }

  _renderAttachments() {
    const notes = [];
    const file = this.el.image && this.el.image.files ? this.el.image.files[0] : null;
    if (file) notes.push(`image: ${file.name}`);
    if (this.recording) notes.push(`recording: ${formatNumber(this.recording.length / INPUT_RATE)} s`);
    setText(this.el.attachments, notes.length ? `Attached: ${notes.join(', ')}` : '');
    show(this.el.attachments, notes.length > 0);
  }

  _render() {
    const busy = this.omni.state === 'generating' || Boolean(this.outgoing) || this.preparing;
    enable(this.el.send, !busy);
    enable(this.el.clear, !busy);
    enable(this.el.apikey, !this.client);
    if (this.el.record) {
      this.el.record.textContent = this.recorder ? 'Stop and send' : 'Record';
      this.el.record.setAttribute('aria-pressed', String(Boolean(this.recorder)));
    }
  }

  _status(text, kind = 'info') {
    setText(this.el.status, text);
    if (this.el.status) this.el.status.dataset.kind = kind;
  }

  _localError(code, text) {
    this.omni.errors.push({ code, message: text });
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
}

/** response.done metrics as one short line: tokens, times, and why the reply ended. */
export function metricsSummary(metrics, reason) {
  const parts = [];
  if (typeof metrics.input_tokens === 'number') parts.push(`${metrics.input_tokens} tokens in`);
  if (typeof metrics.generated_tokens === 'number') parts.push(`${metrics.generated_tokens} out`);
  if (typeof metrics.queue_ms === 'number' && metrics.queue_ms >= 1) parts.push(`waited ${formatNumber(metrics.queue_ms, 0)} ms`);
  if (typeof metrics.prefill_ms === 'number') parts.push(`prefill ${formatNumber(metrics.prefill_ms, 0)} ms`);
  if (typeof metrics.wall_clock_ms === 'number') parts.push(`total ${formatNumber(metrics.wall_clock_ms, 0)} ms`);
  if (reason === 'max_tokens') parts.push('cut at the token limit');
  if (Array.isArray(metrics.ignored) && metrics.ignored.length) parts.push(`not used: ${metrics.ignored.join('; ')}`);
  return parts.join(' · ');
}
