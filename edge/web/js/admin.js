// The admin page: GET /status every 2 s, rendered as workers, queue and sessions tables.
// State for tests and people in the console: window.omni = { state, status, error, refreshes }.

import { el, table } from './dom.js';
import { bindApiKeyField, saveApiKey } from './realtime.js';
import { Ops } from './admin-ops.js';

const REFRESH_MS = 2000;

const omni = {
  state: 'loading', // 'loading' | 'ok' | 'unauthorized' | 'unavailable' | 'error'
  status: null, // the last /status JSON
  error: null, // { code, message } of the last failed refresh, null after a good one
  refreshes: 0, // completed refreshes, good or not
  updatedAt: null, // Date.now() of the last good refresh
};
window.omni = omni;
const ops = new Ops(() => document.getElementById('apikey').value.trim());
omni.ops = ops.state;

const $ = (id) => document.getElementById(id);

function mib(bytes) {
  return `${(bytes / (1024 * 1024)).toFixed(1)} MiB`;
}

function memory(m) {
  if (!m) return '—';
  let text = `${m.device}: ${mib(m.allocated_bytes)} (baseline ${mib(m.baseline_bytes)})`;
  if (m.cleanups) text += `, ${m.cleanups} cleanups`;
  return text;
}

// What the worker serves in real time: engine seconds a session costs per second, late units
// lately and in all, and the modes it would take one more session of now.
function headroom(w) {
  const h = w.headroom;
  if (!h) return '—';
  const costs = Object.entries(h.session_cost || {})
    .map(([mode, cost]) => `${mode} ${Number(cost).toFixed(2)}`)
    .join(', ');
  const admits = (w.admits || []).length ? `takes ${w.admits.join(', ')}` : 'takes none now';
  return `${costs} of ${h.engine_threads} thread(s); late ${h.late_units_recent} in ${h.late_window_s} s (${h.late_units_total} in all); ${admits}`;
}

function health(w) {
  const serving = w.health === 'serving';
  const text = serving ? 'serving' : `${w.health}${w.detail ? `: ${w.detail}` : ''}`;
  return el('span', text, serving ? 'health-serving' : 'health-other');
}

function replace(id, ...nodes) {
  $(id).replaceChildren(...nodes);
}

// Every scheduler the edge is configured with (one, or an active/standby pair): address, pid,
// leading or standby (or not answering), epoch, leaderships begun and the last rebuild.
function renderSchedulers(s) {
  const schedulers = s.schedulers || [];
  if (schedulers.length === 0) {
    replace('schedulers', el('p', 'The edge named no scheduler.', 'muted'));
    return;
  }
  const role = (x) => {
    if (!x.answers) return el('span', 'not answering', 'health-other');
    return x.leading ? el('span', 'leading', 'health-serving') : el('span', 'standby', 'muted');
  };
  const rows = schedulers.map((x) => [
    x.address,
    x.pid ?? '—',
    role(x),
    x.epoch ?? '—',
    x.leaderships ?? '—',
    x.rebuild_s === null || x.rebuild_s === undefined
      ? '—'
      : `${Number(x.rebuild_s).toFixed(2)} s`,
  ]);
  const nodes = [
    table(['address', 'pid', 'role', 'epoch', 'leaderships', 'last rebuild'], rows),
  ];
  if (!s.scheduler_leader) {
    nodes.push(el('p', 'No scheduler leads: new sessions are refused.', 'health-other'));
  }
  replace('schedulers', ...nodes);
}

function render(s) {
  renderSchedulers(s);
  const workers = s.workers || [];
  if (workers.length === 0) {
    replace('workers', el('p', 'No worker is registered with the scheduler.', 'health-other'));
  } else {
    replace(
      'workers',
      table(
        ['worker', 'address', 'engine', 'modes', 'slots', 'free', 'leases', 'health', 'headroom', 'memory'],
        workers.map((w) => [
          w.worker_id,
          w.address,
          w.engine,
          (w.modes || []).join(', '),
          w.slots,
          w.slots_free,
          w.leases,
          health(w),
          headroom(w),
          memory(w.memory),
        ]),
      ),
    );
  }

  const summary = el('div', null, 'admin-summary');
  const item = (label, value) => {
    const d = el('div', `${label}: `);
    d.appendChild(el('span', value));
    summary.appendChild(d);
  };
  item('queued', `${s.queue.length} of max ${s.queue.max}`);
  item('slots free', `${s.slots.free} of ${s.slots.total}`);
  item('leases active', s.leases_active);
  const means = Object.entries(s.mean_session_s || {});
  if (means.length) {
    item('mean session', means.map(([mode, v]) => `${mode} ${Number(v).toFixed(1)} s`).join(', '));
  }
  if (s.edge.draining) item('edge', 'draining');
  replace('queue', summary);

  const sessions = s.sessions || [];
  const chats = el('p', `Chat sessions on this edge: ${s.edge.chat_sessions}`);
  if (sessions.length === 0) {
    replace('sessions', el('p', 'No duplex session on this edge.', 'muted'), chats);
  } else {
    replace(
      'sessions',
      table(
        ['session', 'mode', 'worker', 'started', 'units sent', 'late units'],
        sessions.map((x) => [
          x.session_id,
          x.mode,
          x.worker_id || '—',
          x.started ? 'yes' : 'queued',
          x.units,
          x.late_units ?? '—', // null: its worker's leases were past the scheduler's status bound
        ]),
      ),
      chats,
    );
  }
}

function showMessage(text, isError) {
  const p = $('status');
  p.textContent = text;
  p.className = isError ? 'admin-message error' : 'admin-message';
}

function fail(state, code, message) {
  omni.state = state;
  omni.error = { code, message };
  showMessage(message, true);
}

let inFlight = false;

async function refresh() {
  if (inFlight) return; // a slow edge must not pile up requests
  inFlight = true;
  const key = $('apikey').value.trim();
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch('/status', { headers, cache: 'no-store' });
    if (response.status === 401) {
      fail(
        'unauthorized',
        'unauthorized',
        key
          ? 'The edge refused this API key (401): check it and press Refresh.'
          : 'This edge needs an API key (401): enter it above and press Refresh.',
      );
    } else if (response.status === 503) {
      // The body still lists the schedulers: which one is down, which one would lead.
      const body = await response.json().catch(() => ({}));
      renderSchedulers(body);
      fail(
        'unavailable',
        'scheduler_unavailable',
        'The edge is up but cannot reach the scheduler (503): workers and queue are unknown.',
      );
    } else if (!response.ok) {
      fail('error', `http_${response.status}`, `GET /status answered ${response.status}.`);
    } else {
      const status = await response.json();
      render(status);
      ops.sample(status);
      ops.refreshQueue();
      omni.status = status;
      omni.error = null;
      omni.state = 'ok';
      omni.updatedAt = Date.now();
      $('updated').textContent = `updated ${new Date(omni.updatedAt).toLocaleTimeString()}`;
      const w = status.workers.length;
      showMessage(
        `${w} worker${w === 1 ? '' : 's'}, ${status.sessions.length} duplex session` +
          `${status.sessions.length === 1 ? '' : 's'}, ${status.queue.length} queued.`,
        false,
      );
    }
  } catch (err) {
    fail('error', 'unreachable', `Cannot reach the edge: ${err.message || err}`);
  } finally {
    inFlight = false;
    omni.refreshes += 1;
  }
}

function init() {
  // The same saved key as the session pages (localStorage, this browser only).
  const input = $('apikey');
  bindApiKeyField(input);
  $('controls').addEventListener('submit', (event) => {
    event.preventDefault();
    saveApiKey(input.value.trim());
    refresh();
    ops.refreshAll();
  });
  refresh();
  ops.refreshAll();
  setInterval(refresh, REFRESH_MS);
}

init();
