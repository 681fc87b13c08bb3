// The Realtime WebSocket client shared by every page: the endpoint URL, the API key
// subprotocol, JSON events of the current dialect (session.init, input.append,
// session.close), and base64 <-> float32 PCM conversion.

/** The subprotocol the server selects; the API key travels as a second one. */
export const SUBPROTOCOL = 'map.realtime';

/** Where the pages remember the optional API key (the admin page may share it). */
export const API_KEY_STORAGE = 'omni.apiKey';

/**
 * The WebSocket URL of the Realtime endpoint on the server that served this page:
 * wss:// when the page came over https, ws:// otherwise.
 */
export function realtimeUrl(mode, loc = window.location) {
  const scheme = loc.protocol === 'https:' ? 'wss' : 'ws';
  return `${scheme}://${loc.host}/v1/realtime?mode=${encodeURIComponent(mode)}`;
}

/**
 * The subprotocols to offer. A browser cannot set an Authorization header on a
 * WebSocket, so the key goes as "bearer.<key>"; the server selects only map.realtime.
 */
export function subprotocols(apiKey) {
  const key = (apiKey || '').trim();
  return key ? [SUBPROTOCOL, `bearer.${key}`] : [SUBPROTOCOL];
}

/** The API key saved on this browser, or '' (storage may be unavailable). */
export function loadApiKey() {
  try {
    return window.localStorage.getItem(API_KEY_STORAGE) || '';
  } catch {
    return '';
  }
}

/** Remember the API key on this browser; an empty key is forgotten. */
export function saveApiKey(key) {
  try {
    if (key) window.localStorage.setItem(API_KEY_STORAGE, key);
    else window.localStorage.removeItem(API_KEY_STORAGE);
  } catch {
    // Private browsing or a blocked storage: the key then lasts for this page only.
  }
}

/** Wire an <input> to the saved API key: filled on load, saved on every change. */
export function bindApiKeyField(input) {
  if (!input) return;
  input.value = loadApiKey();
  input.addEventListener('change', () => saveApiKey(input.value.trim()));
}

// ---- base64 and PCM ------------------------------------------------------------------

/** Bytes -> base64 text (in slices: String.fromCharCode takes a bounded argument list). */
export function bytesToBase64(bytes) {
  let binary = '';
  const step = 0x8000;
  for (let i = 0; i < bytes.length; i += step) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + step));
  }
  return btoa(binary);
}

/** base64 text -> bytes. Throws on text that is not base64. */
export function base64ToBytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/** Float32 samples -> base64 of their little-endian bytes (the protocol's PCM format). */
export function encodeFloat32(samples) {
  const bytes = new Uint8Array(samples.length * 4);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < samples.length; i++) view.setFloat32(i * 4, samples[i], true);
  return bytesToBase64(bytes);
}

/** base64 of little-endian float32 bytes -> samples (a trailing partial sample is ignored). */
export function decodeFloat32(text) {
  const bytes = base64ToBytes(text);
  const count = Math.floor(bytes.length / 4);
  const view = new DataView(bytes.buffer, 0, count * 4);
  const samples = new Float32Array(count);
  for (let i = 0; i < count; i++) samples[i] = view.getFloat32(i * 4, true);
  return samples;
}

// ---- the connection ------------------------------------------------------------------

/** Delays before each reconnect attempt of a dropped session (then the last, until its
 * resume window ends), ms. */
export const RECONNECT_DELAYS_MS = [0, 250, 500, 1000, 2000];

/**
 * One Realtime session over one WebSocket, resumed over a new one when the connection
 * drops (the server gave a resume token and the session did not end).
 *
 * Server events are delivered to `onEvent(event)` as parsed objects (after a resume:
 * `session.resumed`, then the events the lost connection missed); the session's end to
 * `onClose({code, reason, wasClean})`, exactly once. While it reconnects,
 * `onReconnecting({attempt, code})` is called before each attempt and `send()` returns
 * false. `connect()` throws synchronously when the browser refuses the URL or the
 * subprotocols (e.g. a key with characters a subprotocol cannot carry); every later
 * failure arrives through onClose.
 */
export class RealtimeClient {
  constructor({ mode, apiKey = '', url = realtimeUrl(mode), onEvent, onClose, onReconnecting }) {
    this.mode = mode;
    this.apiKey = apiKey;
    this.url = url;
    this.onEvent = onEvent || (() => {});
    this.onClose = onClose || (() => {});
    this.onReconnecting = onReconnecting || (() => {});
    this.ws = null;
    this.closed = false;
    this.resumeToken = '';
    this.resumeWindowMs = 0;
    this.lastSeq = 0;
    this.ended = false; // session.closed (or a refused resume) came: nothing to resume
    this.leaving = false; // the page closed the session itself
    this.lostAt = null;
    this.attempt = 0;
    this.reconnectTimer = null;
  }

  /** Open the socket. */
  connect() {
    this._open(this.url);
  }

  _open(url) {
    const ws = new WebSocket(url, subprotocols(this.apiKey));
    this.ws = ws;
    ws.addEventListener('message', (msg) => ws === this.ws && this._receive(msg));
    ws.addEventListener('close', (ev) => ws === this.ws && this._lost(ev.code, ev.reason, ev.wasClean));
  }

  /** True while events can be sent. */
  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN && this.lostAt === null;
  }

  /** True while a dropped session is being resumed. */
  get reconnecting() {
    return this.lostAt !== null && !this.closed;
  }

  /** Bytes queued in the browser and not yet on the wire (back-pressure signal). */
  get bufferedAmount() {
    return this.ws ? this.ws.bufferedAmount : 0;
  }

  /** Send one event; returns false (nothing sent) when the socket is not open. */
  send(event) {
    if (!this.open) return false;
    this.ws.send(JSON.stringify(event));
    return true;
  }

  /** session.init with an object payload (the current dialect). */
  init(payload = {}) {
    return this.send({ type: 'session.init', payload });
  }

  /** input.append with an object input: {audio, video_frames?, force_listen?} or chat. */
  append(input) {
    return this.send({ type: 'input.append', input });
  }

  /** session.close; the server answers session.closed and closes the socket. */
  close(reason = 'user_stop') {
    this.leaving = true;
    return this.send({ type: 'session.close', reason });
  }

  /** Drop the socket at once (no session.close), e.g. when the server stops answering. */
  abort(code = 1000, reason = 'client closed') {
    this.leaving = true;
    clearTimeout(this.reconnectTimer);
    if (this.ws && this.ws.readyState < WebSocket.CLOSING) this.ws.close(code, reason);
    else if (this.lostAt !== null) this._closed(code, reason, false);
  }

  _receive(msg) {
    if (typeof msg.data !== 'string') return; // the protocol has text frames only
    let event;
    try {
      event = JSON.parse(msg.data);
    } catch {
      return;
    }
    if (!event || typeof event !== 'object' || typeof event.type !== 'string') return;
    if (typeof event.seq === 'number') this.lastSeq = event.seq;
    if (event.type === 'session.created' && typeof event.resume_token === 'string') {
      this.resumeToken = event.resume_token;
      this.resumeWindowMs = 1000 * (Number(event.resume_window_s) || 0);
    } else if (event.type === 'session.resumed') {
      this.lostAt = null;
      this.attempt = 0;
    } else if (event.type === 'session.closed') {
      this.ended = true;
    } else if (event.type === 'error' && event.error && /^resume_/.test(event.error.code || '')) {
      this.ended = true; // the session cannot be resumed: this connection's end is final
    }
    this.onEvent(event);
  }

  /** The socket ended: resume the session on a new one, or report the end. */
  _lost(code, reason, wasClean) {
    const resumable = this.resumeToken && !this.ended && !this.leaving && code !== 1000;
    if (!resumable) {
      this._closed(code, reason, wasClean);
      return;
    }
    if (this.lostAt === null) this.lostAt = performance.now();
    if (performance.now() - this.lostAt > this.resumeWindowMs) {
      this._closed(code, reason, wasClean);
      return;
    }
    const delay = RECONNECT_DELAYS_MS[Math.min(this.attempt, RECONNECT_DELAYS_MS.length - 1)];
    this.attempt += 1;
    this.onReconnecting({ attempt: this.attempt, code });
    const sep = this.url.includes('?') ? '&' : '?';
    const url = `${this.url}${sep}resume_token=${encodeURIComponent(this.resumeToken)}&last_seq=${this.lastSeq}`;
    this.reconnectTimer = setTimeout(() => {
      if (this.closed || this.leaving) return;
      try {
        this._open(url);
      } catch {
        this._closed(code, reason, wasClean);
      }
    }, delay);
  }

  _closed(code, reason, wasClean) {
    if (this.closed) return;
    this.closed = true;
    this.lostAt = null;
    this.onClose({ code, reason, wasClean });
  }
}
