// Which apps (kinds of session) the operator has switched off (GET /api/apps): links to
// them are marked, and a page of a switched-off app says so before anyone presses start.
const ROUTES = ['/audio', '/half_duplex', '/video', '/chat'];

export async function markSwitchedOff(doc = document) {
  let enabled;
  try {
    const reply = await fetch('/api/apps');
    if (!reply.ok) return [];
    enabled = new Set((await reply.json()).apps.map((app) => app.route));
  } catch {
    return []; // an older edge, or offline: nothing to mark
  }
  const off = ROUTES.filter((route) => !enabled.has(route));
  for (const link of doc.querySelectorAll('a[href]')) {
    if (off.includes(link.getAttribute('href'))) {
      link.classList.add('switched-off');
      link.title = 'switched off by the operator';
    }
  }
  if (off.includes(doc.location.pathname)) {
    const notice = doc.createElement('p');
    notice.id = 'switched-off';
    notice.className = 'notice';
    notice.textContent =
      'The operator has switched this kind of session off for now: new sessions are refused.';
    (doc.querySelector('main') || doc.body).prepend(notice);
  }
  return off;
}

markSwitchedOff();
