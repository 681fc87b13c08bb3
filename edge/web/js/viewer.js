// The session viewer (/s/<id>): a recording's facts, its audio and its per-unit timeline,
// from GET /api/sessions/<id> and its assets (with the saved API key when the edge needs one).
import { bindApiKeyField, loadApiKey, saveApiKey } from './realtime.js';

const $ = (id) => document.getElementById(id);
const sid = decodeURIComponent(window.location.pathname.split('/s/')[1] || '');
const omni = { loaded: false, units: 0, error: null, audio: [] };
window.omni = omni;
const urls = [];

function headers() {
  const key = loadApiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function get(path) {
  const reply = await fetch(path, { headers: headers() });
  if (reply.status === 401) throw new Error('This edge needs an API key: enter it above and press Load.');
  if (!reply.ok) {
    let text = `${reply.status}`;
    try { text = (await reply.json()).message || text; } catch { /* not JSON */ }
    throw new Error(text);
  }
  return reply;
}

async function blobUrl(path) {
  const url = URL.createObjectURL(await (await get(path)).blob());
  urls.push(url);
  return url;
}

function row(cells, tag = 'td') {
  const tr = document.createElement('tr');
  for (const cell of cells) {
    const td = document.createElement(tag);
    td.textContent = cell === null || cell === undefined ? '' : String(cell);
    tr.append(td);
  }
  return tr;
}

function showMeta(meta) {
  const table = $('meta');
  table.replaceChildren();
  const facts = [
    ['mode', meta.mode], ['started', meta.started_at], ['ended', meta.ended_at],
    ['closed', meta.close_reason], ['units', meta.units], ['system prompt', meta.system_prompt],
  ];
  for (const [name, value] of facts) {
    const tr = row([value]);
    const th = document.createElement('th');
    th.textContent = name;
    tr.prepend(th);
    table.append(tr);
  }
}

function plot(units) {
  const canvas = $('plot');
  const ctx = canvas.getContext('2d');
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  if (!units.length) return;
  const top = Math.max(100, ...units.map((u) => u.wall_clock_ms || 0), ...units.map((u) => u.edge_ms || 0));
  const step = width / units.length;
  const y = (ms) => height - (ms / top) * (height - 12);
  units.forEach((u, i) => {
    ctx.fillStyle = u.kind === 'speak' ? '#1a7f37' : u.kind === 'dropped' ? '#b00020' : '#9aa0a6';
    const ms = u.kind === 'dropped' ? top : (u.wall_clock_ms || 0);
    ctx.fillRect(i * step + 1, y(ms), Math.max(1, step - 2), height - y(ms));
  });
  ctx.strokeStyle = '#1a4fa0';
  ctx.beginPath();
  units.forEach((u, i) => {
    const x = i * step + step / 2;
    if (i === 0) ctx.moveTo(x, y(u.edge_ms || 0)); else ctx.lineTo(x, y(u.edge_ms || 0));
  });
  ctx.stroke();
  ctx.fillStyle = '#333';
  ctx.fillText(`${Math.round(top)} ms`, 4, 10);
}

function showUnits(units) {
  const body = $('units').querySelector('tbody');
  body.replaceChildren(...units.map((u) => {
    const tr = row([u.seq, u.kind, u.text, u.prefill_ms, u.generate_ms, u.wall_clock_ms, u.edge_ms]);
    tr.className = `kind-${u.kind}`;
    return tr;
  }));
}

async function load() {
  omni.error = null;
  $('message').textContent = 'Loading…';
  try {
    if (!/^[A-Za-z0-9_-]{1,128}$/.test(sid)) throw new Error('This is not a session link.');
    const meta = await (await get(`/api/sessions/${sid}`)).json();
    showMeta(meta);
    showUnits(meta.timeline);
    plot(meta.timeline);
    omni.units = meta.timeline.length;
    for (const name of ['user', 'model']) {
      try {
        $(name).src = await blobUrl(`/api/sessions/${sid}/assets/${name}.wav`);
        omni.audio.push(name);
      } catch { /* a session without speech has no model.wav */ }
    }
    const link = $('download');
    link.hidden = false;
    link.onclick = async (event) => {
      event.preventDefault();
      const a = document.createElement('a');
      a.href = await blobUrl(`/api/sessions/${sid}/download`);
      a.download = `${sid}.zip`;
      a.click();
    };
    $('message').textContent = `${omni.units} units`;
    omni.loaded = true;
  } catch (err) {
    omni.error = err.message;
    $('message').textContent = err.message;
  }
}

$('sid').textContent = sid;
bindApiKeyField($('apikey'));
$('controls').addEventListener('submit', (event) => {
  event.preventDefault();
  saveApiKey($('apikey').value.trim());
  load();
});
load();
