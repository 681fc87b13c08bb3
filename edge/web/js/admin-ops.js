// The admin page's operator tools, on the edge's HTTP API (edge/api.py): the queue with
// cancel, the wait estimate, apps on and off, registered voices, presets, recorded sessions,
// and plots of the queue length and this edge's unit time over the last minutes.
// Actions are the operator endpoints: an admin key when the edge has keys (the page's saved
// key is sent), a browser on the edge's own host (loopback) when it has none; a refusal shows
// the edge's reason.

import { el, table } from './dom.js';

const HISTORY_S = 300;
const history = []; // { t, queued, p50, p99 }

const $ = (id) => document.getElementById(id);

function button(text, onClick) {
  const b = el('button', text);
  b.type = 'button';
  b.addEventListener('click', onClick);
  return b;
}

export class Ops {
  constructor(keyOf) {
    this.keyOf = keyOf; // () => the API key to send
    this.state = { queue: null, eta: null, apps: null, voices: null, presets: null, recordings: null, lastAction: null };
  }

  async call(method, path, body) {
    const key = this.keyOf();
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const reply = await fetch(path, {
      method, headers, cache: 'no-store', body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    try { data = await reply.json(); } catch { /* not JSON */ }
    if (!reply.ok) {
      const why = (data && (data.message || data.detail)) || `${reply.status}`;
      throw new Error(`${method} ${path}: ${why}`);
    }
    return data;
  }

  say(text, isError) {
    const p = $('ops-message');
    p.textContent = text;
    p.className = isError ? 'admin-message error' : 'admin-message';
    this.state.lastAction = { text, isError: !!isError };
  }

  async act(what, method, path, body) {
    try {
      const data = await this.call(method, path, body);
      this.say(`${what}: done`, false);
      await this.refreshAll();
      return data;
    } catch (err) {
      this.say(`${what}: ${err.message}`, true);
      return null;
    }
  }

  // ---- per refresh (every 2 s with the status) ----------------------------------------

  sample(status) {
    const now = Date.now() / 1000;
    const units = status.units_recent || {};
    history.push({ t: now, queued: status.queue.length, p50: units.p50_ms, p99: units.p99_ms });
    while (history.length && history[0].t < now - HISTORY_S) history.shift();
    this.plot();
  }

  plot() {
    const canvas = $('ops-plot');
    if (!canvas) return;
    const ctx = canvas.getContext('2d');
    const { width, height } = canvas;
    ctx.clearRect(0, 0, width, height);
    if (history.length < 2) return;
    const t0 = history[history.length - 1].t - HISTORY_S;
    const x = (t) => ((t - t0) / HISTORY_S) * width;
    const series = (key, color, top) => {
      ctx.strokeStyle = color;
      ctx.beginPath();
      let started = false;
      for (const h of history) {
        if (h[key] === null || h[key] === undefined) { started = false; continue; }
        const y = height - 14 - (h[key] / top) * (height - 28);
        if (started) ctx.lineTo(x(h.t), y); else ctx.moveTo(x(h.t), y);
        started = true;
      }
      ctx.stroke();
    };
    const topQueue = Math.max(1, ...history.map((h) => h.queued));
    const topMs = Math.max(10, ...history.map((h) => h.p99 || 0));
    series('queued', '#b35900', topQueue);
    series('p50', '#1a7f37', topMs);
    series('p99', '#1a4fa0', topMs);
    ctx.fillStyle = '#333';
    ctx.fillText(`queued (orange, max ${topQueue}) · unit p50 (green) / p99 (blue), max ${Math.round(topMs)} ms · last ${HISTORY_S / 60} min`, 4, 10);
  }

  async refreshQueue() {
    try {
      const q = await this.call('GET', '/api/queue');
      this.state.queue = q;
      const rows = q.items.map((item) => [
        item.position, item.request_type, item.session_id, `${item.wait_elapsed_s} s`,
        `${item.estimated_wait_s} s`,
        button('Cancel', () => this.act(`cancel ${item.ticket_id}`, 'DELETE', `/api/queue/${encodeURIComponent(item.ticket_id)}`)),
      ]);
      $('ops-queue').replaceChildren(rows.length
        ? table(['position', 'type', 'session', 'waited', 'estimate', ''], rows)
        : el('p', 'Nobody is waiting.', 'muted'));
    } catch (err) {
      $('ops-queue').replaceChildren(el('p', err.message, 'muted'));
    }
  }

  // ---- on load and after an action ------------------------------------------------------

  async refreshAll() {
    await Promise.all([
      this.refreshQueue(), this.refreshEta(), this.refreshApps(), this.refreshVoices(),
      this.refreshPresets(), this.refreshRecordings(),
    ]);
  }

  async refreshEta() {
    try {
      const eta = await this.call('GET', '/api/config/eta');
      this.state.eta = eta;
      const form = el('form');
      form.id = 'ops-eta-form';
      const fields = [
        ['eta_audio_duplex_s', 'audio duplex s', eta.config.eta_audio_duplex_s],
        ['eta_omni_duplex_s', 'omni duplex s', eta.config.eta_omni_duplex_s],
        ['eta_chat_s', 'chat s', eta.config.eta_chat_s],
        ['ema_alpha', 'smoothing (0-1]', eta.ema_alpha],
      ];
      for (const [name, label, value] of fields) {
        const l = el('label', `${label} `);
        const input = el('input');
        input.name = name;
        input.type = 'number';
        input.step = 'any';
        input.value = value;
        input.size = 6;
        l.appendChild(input);
        form.appendChild(l);
      }
      const save = el('button', 'Save');
      save.type = 'submit';
      form.appendChild(save);
      form.addEventListener('submit', (event) => {
        event.preventDefault();
        const body = {};
        for (const [name] of fields) body[name] = Number(form.elements[name].value);
        this.act('wait estimate', 'PUT', '/api/config/eta', body);
      });
      const seen = ['audio_duplex', 'omni_duplex', 'chat'].map((n) =>
        `${n}: ${eta[`ema_${n}_s`] === null ? 'none seen' : `${Number(eta[`ema_${n}_s`]).toFixed(1)} s over ${eta[`ema_${n}_samples`]}`}`).join(' · ');
      $('ops-eta').replaceChildren(form, el('p', `observed: ${seen}`, 'muted'));
    } catch (err) {
      $('ops-eta').replaceChildren(el('p', err.message, 'muted'));
    }
  }

  async refreshApps() {
    try {
      const apps = (await this.call('GET', '/api/admin/apps')).apps;
      this.state.apps = apps;
      $('ops-apps').replaceChildren(table(['app', 'page', 'state', ''], apps.map((a) => [
        a.name, a.route, a.enabled ? 'on' : 'off',
        button(a.enabled ? 'Switch off' : 'Switch on', () => this.act(
          `${a.app_id} ${a.enabled ? 'off' : 'on'}`, 'PUT', `/api/admin/apps/${a.app_id}`, { enabled: !a.enabled })),
      ])));
    } catch (err) {
      $('ops-apps').replaceChildren(el('p', err.message, 'muted'));
    }
  }

  async refreshVoices() {
    try {
      const voices = (await this.call('GET', '/api/assets/ref_audio')).ref_audios;
      this.state.voices = voices;
      const rows = voices.map((v) => [v.name, `${(v.duration_ms / 1000).toFixed(1)} s`, v.id,
        button('Delete', () => this.act(`delete voice ${v.name}`, 'DELETE', `/api/assets/ref_audio/${v.id}`))]);
      const upload = el('form');
      const name = el('input');
      name.placeholder = 'name';
      name.name = 'name';
      const file = el('input');
      file.type = 'file';
      file.accept = '.wav,audio/wav';
      file.name = 'file';
      const add = el('button', 'Upload WAV');
      add.type = 'submit';
      upload.append(name, file, add);
      upload.addEventListener('submit', async (event) => {
        event.preventDefault();
        const chosen = file.files[0];
        if (!chosen) { this.say('choose a WAV file first', true); return; }
        const bytes = new Uint8Array(await chosen.arrayBuffer());
        let binary = '';
        for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
        this.act(`upload ${name.value || chosen.name}`, 'POST', '/api/assets/ref_audio',
          { name: name.value || chosen.name, audio_base64: btoa(binary) });
      });
      $('ops-voices').replaceChildren(
        rows.length ? table(['voice', 'length', 'id (ref_audio_id)', ''], rows) : el('p', 'No registered voice.', 'muted'),
        upload,
      );
    } catch (err) {
      $('ops-voices').replaceChildren(el('p', err.message, 'muted'));
    }
  }

  async refreshPresets() {
    try {
      const presets = await this.call('GET', '/api/presets');
      this.state.presets = presets;
      const rows = [];
      for (const [mode, list] of Object.entries(presets)) {
        for (const p of list) rows.push([mode, p.name, p.description, p.system_prompt || '(parts)', p.ref_audio ? p.ref_audio.name : '']);
      }
      $('ops-presets').replaceChildren(rows.length
        ? table(['mode', 'preset', 'description', 'system prompt', 'voice'], rows)
        : el('p', 'No presets.', 'muted'));
    } catch (err) {
      $('ops-presets').replaceChildren(el('p', err.message, 'muted'));
    }
  }

  async refreshRecordings() {
    try {
      const list = await this.call('GET', '/api/sessions');
      this.state.recordings = list;
      const rows = list.sessions.slice(0, 50).map((s) => {
        const link = el('a', s.session_id);
        link.href = `/s/${encodeURIComponent(s.session_id)}`;
        return [link, s.mode, s.started_at, s.duration_s === null ? '' : `${s.duration_s} s`, s.units, s.close_reason];
      });
      $('ops-recordings').replaceChildren(rows.length
        ? table(['session (viewer)', 'mode', 'started', 'length', 'units', 'closed'], rows)
        : el('p', 'No recorded session yet.', 'muted'));
    } catch (err) {
      $('ops-recordings').replaceChildren(el('p', err.message, 'muted'));
    }
  }
}
