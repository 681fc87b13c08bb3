// Small DOM helpers shared by the pages. Every helper accepts a missing element (null), so
// a page copied without some optional part still works.

/** The element with this id, or null. */
export function byId(id) {
  return document.getElementById(id);
}

/** Set an element's text (no HTML is ever interpreted). */
export function setText(el, text) {
  if (el) el.textContent = text;
}

/** Show or hide an element. */
export function show(el, visible) {
  if (el) el.hidden = !visible;
}

/** Enable or disable a control. */
export function enable(el, enabled) {
  if (el) el.disabled = !enabled;
}

/** Seconds as m:ss (e.g. 9:58). */
export function formatSeconds(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, '0')}`;
}

/** A number with at most `digits` decimals, or '' for a missing value. */
export function formatNumber(value, digits = 1) {
  if (typeof value !== 'number' || !Number.isFinite(value)) return '';
  return String(Math.round(value * 10 ** digits) / 10 ** digits);
}

/** Append an item to a list element (e.g. the page's list of errors), newest last. */
export function appendItem(list, text, limit = 20) {
  if (!list) return;
  const item = document.createElement('li');
  item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  list.appendChild(item);
  while (list.children.length > limit) list.removeChild(list.firstChild);
}

/**
 * Wrap an event handler so a failure is reported on the page instead of escaping as an
 * uncaught exception (sync throws and rejected promises alike).
 */
export function guarded(handler, report) {
  return (...args) => {
    try {
      const result = handler(...args);
      if (result && typeof result.catch === 'function') result.catch(report);
    } catch (err) {
      report(err);
    }
  };
}
