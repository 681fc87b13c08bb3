// The half-duplex voice call page (half_duplex.html): the microphone in half-second
// chunks, the server finds the end of the user's turn, the model's answer streams as text
// and speech; while it answers (and until its speech has played) the page sends nothing,
// so the model never hears itself. Everything the page knows is mirrored in `window.omni`.
//
// Protocol (the reference server's /ws/half_duplex/{session_id}):
//   <- queued / queue_update / queue_done
//   -> prepare {system_content, config: {vad, generation, tts, session}}   <- prepared
//   -> audio_chunk {audio_base64}   (float32 16 kHz, 0.5 s each)
//   <- vad_state {speaking}   <- generating {speech_duration_ms}
//   <- chunk {text_delta, audio_data}*   <- turn_done {turn_index, text}
//   -> stop   <- stopped        (or <- timeout {elapsed_s})       <- error {error} any time

import { INPUT_RATE, MicCapture, UnitAssembler } from './capture.js';
import { mediaErrorText, socketCloseText } from './messages.js';
import { Player } from './player.js';
import { bindApiKeyField, bytesToBase64, decodeFloat32, saveApiKey, subprotocols } from './realtime.js';
import { appendItem, byId, enable, guarded, setText, show } from './ui.js';

/** Samples per audio_chunk: half a second, as the reference server's page sends. */
export const CHUNK_SAMPLES = INPUT_RATE / 2;
/** How long to wait for `stopped` after `stop` before dropping the socket. */
const STOP_WAIT_MS = 3000;
/** How often the page checks whether the answer's speech has finished playing. */
const RESUME_POLL_MS = 100;

/** The WebSocket URL of a new call on the server that served this page. */
export function callUrl(sessionId, loc = window.location) {
  const scheme = loc.protocol === 'https:' ? 'wss' : 'ws';
  return `${scheme}://${loc.host}/ws/half_duplex/${encodeURIComponent(sessionId)}`;
}

/** A new call id (the server takes [A-Za-z0-9_-], at most 64 characters). */
export function newCallId() {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  return `hdx_${Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('')}`;
}

/** The call's settings from the page's fields, in the protocol's `config` shape. */
export function readConfig(fields) {
  const number = (el, fallback) => {
    const value = Number(el && el.value);
    return el && el.value !== '' && Number.isFinite(value) ? value : fallback;
  };
  return {
    vad: {
      threshold: number(fields.threshold, 0.7),
      min_speech_duration_ms: Math.round(number(fields.speechMs, 128)),
      min_silence_duration_ms: Math.round(number(fields.silence, 500)),
    },
    generation: {
      max_new_tokens: Math.round(number(fields.maxTokens, 256)),
      temperature: number(fields.temperature, 0.7),
    },
    tts: { enabled: fields.spoken ? Boolean(fields.spoken.checked) : true },
    session: { timeout_s: Math.round(number(fields.timeout, 180)) },
  };
}

function freshState() {
  return {
    state: 'idle', // idle | connecting | queued | active | closed
    phase: null, // listening | speaking | thinking | answering | null
    sessionId: null,
    recordingId: null,
    queue: null,
    turns: [], // {index, heardMs, text}
    answer: '', // the answer being streamed
    chunksSent: 0,
    chunksHeld: 0, // not sent: the model was answering or its speech was playing
    audioSamplesReceived: 0,
    audioSamplesPlayed: 0,
    errors: [],
    closeReason: null,
  };
}

class HalfDuplexPage {
  constructor() {
    this.omni = freshState();
    window.omni = this.omni;
    this.ws = null;
    this.mic = null;
    this.player = null;
    this.assembler = new UnitAssembler(CHUNK_SAMPLES, (chunk) => this.sendChunk(chunk));
    this.answering = false;
    this.heardMs = 0;
    this.answerItem = null;
    this.resumeTimer = null;
    this.stopTimer = null;
    this.levelTimer = null;
    this.report = (err) => this.fail(err instanceof Error ? err.message : String(err));
  }

  bind() {
    bindApiKeyField(byId('apikey'));
    byId('start').addEventListener('click', guarded(() => this.start(), this.report));
    byId('stop').addEventListener('click', guarded(() => this.stop(), this.report));
    byId('stop-answer').addEventListener('click', guarded(() => this.stopAnswer(), this.report));
    this.render('Press Start, then speak.');
  }

  // ---- the call --------------------------------------------------------------------

  start() {
    if (this.ws) return;
    Object.assign(this.omni, freshState(), { state: 'connecting', sessionId: newCallId() });
    setText(byId('conversation'), '');
    setText(byId('close-detail'), '');
    show(byId('recording'), false);
    this.answering = false;
    this.player = new Player();
    this.player.unlock(); // inside the click: browsers let the page play audio from here on
    const key = apiKey();
    saveApiKey(key);
    // The key as a `bearer.` subprotocol beside map.realtime, as every page offers it.
    const ws = new WebSocket(callUrl(this.omni.sessionId), subprotocols(key));
    this.ws = ws;
    ws.onmessage = guarded((event) => this.onMessage(JSON.parse(event.data)), this.report);
    ws.onclose = (event) => this.onClose(event);
    this.render('Connecting…');
  }

  prepare() {
    const prompt = (byId('prompt') && byId('prompt').value.trim()) || '';
    const config = readConfig({
      threshold: byId('vad-threshold'),
      silence: byId('vad-silence'),
      speechMs: byId('vad-speech'),
      maxTokens: byId('max-tokens'),
      temperature: byId('temperature'),
      spoken: byId('speech'),
      timeout: byId('timeout'),
    });
    const systemContent = prompt ? [{ type: 'text', text: prompt }] : [];
    this.send({ type: 'prepare', system_content: systemContent, config });
  }

  async openMicrophone() {
    const mic = new MicCapture({ onChunk: (samples) => this.assembler.push(samples) });
    this.mic = mic;
    try {
      if (!(await mic.start())) return; // the call was stopped meanwhile
    } catch (err) {
      // Stopped while the microphone opened: its release is no failure of the call.
      if (this.mic !== mic) return;
      this.fail(mediaErrorText(err));
      this.stop();
      return;
    }
    if (this.mic !== mic) return;
    this.assembler.reset();
    this.levelTimer = setInterval(() => {
      const meter = byId('mic-level');
      if (meter && this.mic) meter.value = Math.min(1, this.mic.level * 4);
    }, 100);
  }

  sendChunk(samples) {
    if (this.omni.state !== 'active') return;
    if (this.answering || (this.player && this.player.busy)) {
      this.omni.chunksHeld += 1;
      return;
    }
    const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
    if (this.send({ type: 'audio_chunk', audio_base64: bytesToBase64(bytes) })) {
      this.omni.chunksSent += 1;
    }
  }

  stop() {
    if (!this.ws) return;
    if (this.ws.readyState === WebSocket.OPEN) {
      this.send({ type: 'stop' });
      const ws = this.ws;
      this.stopTimer = setTimeout(() => ws.close(1000, 'stopped'), STOP_WAIT_MS);
    } else {
      this.ws.close();
    }
    this.closeMedia();
    this.render('Ending the call…');
  }

  async stopAnswer() {
    if (!this.answering || !this.omni.sessionId) return;
    const key = apiKey();
    const headers = { 'Content-Type': 'application/json' };
    if (key) headers.Authorization = `Bearer ${key}`;
    const reply = await fetch('/api/half_duplex/stop', {
      method: 'POST',
      headers,
      body: JSON.stringify({ session_id: this.omni.sessionId }),
    });
    if (!reply.ok) this.fail(`Stop answer: the server answered ${reply.status}.`);
    if (this.player) this.player.flush();
  }

  send(message) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(message));
    return true;
  }

  // ---- server events ---------------------------------------------------------------

  onMessage(msg) {
    const omni = this.omni;
    switch (msg.type) {
      case 'queued':
      case 'queue_update':
        omni.state = 'queued';
        omni.queue = { position: msg.position, eta_s: msg.estimated_wait_s };
        this.render('Waiting for a free model…');
        break;
      case 'queue_done':
        omni.queue = null;
        this.prepare();
        this.render('Preparing the call…');
        break;
      case 'prepared':
        omni.state = 'active';
        omni.recordingId = msg.recording_session_id || null;
        this.setPhase('listening');
        this.openMicrophone();
        this.render('Listening: speak, then pause.');
        break;
      case 'vad_state':
        this.setPhase(msg.speaking ? 'speaking' : 'listening');
        break;
      case 'generating':
        this.answering = true;
        this.heardMs = msg.speech_duration_ms || 0;
        omni.answer = '';
        this.answerItem = this.addTurnItem(this.heardMs);
        this.setPhase('thinking');
        break;
      case 'chunk':
        if (msg.text_delta) {
          omni.answer += msg.text_delta;
          if (this.answerItem) setText(this.answerItem.querySelector('.answer'), omni.answer);
        }
        if (msg.audio_data) {
          const samples = decodeFloat32(msg.audio_data);
          omni.audioSamplesReceived += samples.length;
          this.player.enqueue(samples);
          omni.audioSamplesPlayed = this.player.samplesPlayed;
        }
        this.setPhase('answering');
        break;
      case 'turn_done':
        omni.turns.push({ index: msg.turn_index, heardMs: this.heardMs, text: msg.text });
        if (this.answerItem) setText(this.answerItem.querySelector('.answer'), msg.text || '(no words)');
        setText(byId('turns'), String(omni.turns.length));
        this.answerItem = null;
        this.resumeListening();
        break;
      case 'timeout':
        omni.closeReason = 'timeout';
        setText(byId('close-detail'), `The call ended after ${msg.elapsed_s} s without audio.`);
        break;
      case 'stopped':
        omni.closeReason = 'stopped';
        if (this.ws) this.ws.close(1000, 'stopped');
        break;
      case 'error':
        this.fail(msg.error || 'The server reported an error.');
        break;
      default:
        break; // newer servers may send more: ignored
    }
    enable(byId('stop-answer'), this.answering);
  }

  /** Once the answer's speech has played, the microphone's chunks go out again. */
  resumeListening() {
    clearTimeout(this.resumeTimer);
    const poll = () => {
      if (this.player && this.player.busy) {
        this.resumeTimer = setTimeout(poll, RESUME_POLL_MS);
        return;
      }
      this.answering = false;
      this.assembler.reset(); // what was captured while the answer played is dropped
      enable(byId('stop-answer'), false);
      if (this.omni.state === 'active') {
        this.setPhase('listening');
        this.render('Listening: speak, then pause.');
      }
    };
    poll();
  }

  onClose(event) {
    clearTimeout(this.stopTimer);
    clearTimeout(this.resumeTimer);
    this.ws = null;
    this.closeMedia();
    const omni = this.omni;
    omni.state = 'closed';
    this.answering = false;
    this.setPhase(null);
    if (!omni.closeReason) {
      omni.closeReason = event.reason || `code ${event.code}`;
      setText(byId('close-detail'), socketCloseText(event.code, event.reason));
    }
    if (omni.recordingId) {
      const link = document.createElement('a');
      link.href = `/s/${encodeURIComponent(omni.recordingId)}`;
      link.textContent = 'Play the call back';
      const note = byId('recording');
      if (note) {
        note.textContent = 'Recorded: ';
        note.appendChild(link);
        show(note, true);
      }
    }
    this.render(omni.closeReason === 'stopped' ? 'Call ended.' : 'The call has ended.');
  }

  closeMedia() {
    if (this.mic) this.mic.stop();
    this.mic = null;
    clearInterval(this.levelTimer);
    const meter = byId('mic-level');
    if (meter) meter.value = 0;
  }

  // ---- the page --------------------------------------------------------------------

  addTurnItem(heardMs) {
    const list = byId('conversation');
    if (!list) return null;
    const item = document.createElement('li');
    const you = document.createElement('p');
    you.className = 'you';
    you.textContent = `You spoke for ${(heardMs / 1000).toFixed(1)} s.`;
    const answer = document.createElement('p');
    answer.className = 'answer';
    item.append(you, answer);
    list.appendChild(item);
    return item;
  }

  setPhase(phase) {
    this.omni.phase = phase;
    const el = byId('phase');
    const labels = {
      listening: 'Listening',
      speaking: 'Hearing you',
      thinking: 'Thinking',
      answering: 'Answering',
    };
    if (el) {
      el.dataset.phase = phase === 'answering' ? 'speaking' : phase || 'none';
      el.textContent = phase ? labels[phase] : 'Not connected';
    }
  }

  render(status) {
    const omni = this.omni;
    setText(byId('status'), status);
    const inCall = omni.state === 'connecting' || omni.state === 'queued' || omni.state === 'active';
    enable(byId('start'), !inCall);
    enable(byId('stop'), inCall);
    const queue = byId('queue');
    show(queue, Boolean(omni.queue));
    if (omni.queue) {
      const eta = omni.queue.eta_s != null ? `, about ${Math.round(omni.queue.eta_s)} s` : '';
      setText(queue, `Place in the waiting line: ${omni.queue.position}${eta}.`);
    }
  }

  fail(text) {
    this.omni.errors.push(text);
    appendItem(byId('errors'), text);
  }
}

function apiKey() {
  return (byId('apikey') && byId('apikey').value.trim()) || '';
}

const page = new HalfDuplexPage();
page.bind();
