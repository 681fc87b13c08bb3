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

/**
 * One Realtime session over one WebSocket.
 *
 * Server events are delivered to `onEvent(event)` as parsed objects; the socket's end to
 * `onClose({code, reason, wasClean})`, exactly once. `connect()` throws synchronously when
 * the browser refuses the URL or the subprotocols (e.g. a key with characters a
 * subprotocol cannot carry); every later failure arrives through onClose.
 */
export class RealtimeClient {
  constructor({ mode, apiKey = '', url = realtimeUrl(mode), onEvent, onClose }) {
    this.mode = mode;
    this.apiKey = apiKey;
    this.url = url;
    this.onEvent = onEvent || (() => {});
    this.onClose = onClose || (() => {});
    this.ws = null;
    this.closed = false;
  }

  /** Open the socket. */
  connect() {
    this.ws = new WebSocket(this.url, subprotocols(this.apiKey));
    this.ws.addEventListener('message', (msg) => this._receive(msg));
    this.ws.addEventListener('close', (ev) => this._closed(ev.code, ev.reason, ev.wasClean));
  }

  /** True while events can be sent. */
  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
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
    return this.send({ type: 'session.close', reason });
  }

  /** Drop the socket at once (no session.close), e.g. when the server stops answering. */
  abort(code = 1000, reason = 'client closed') {
    if (this.ws && this.ws.readyState < WebSocket.CLOSING) this.ws.close(code, reason);
  }

  _receive(msg) {
    if (typeof msg.data !== 'string') return; // the protocol has text frames only
    let event;
    try {
      event = JSON.parse(msg.data);
    } catch {
      return;
    }
    if (event && typeof event === 'object' && typeof event.type === 'string') {
      this.onEvent(event);
    }
  }

  _closed(code, reason, wasClean) {
    if (this.closed) return;
    this.closed = true;
    this.onClose({ code, reason, wasClean });
  }
}
