// Small DOM builders shared by the admin pages: text only, so ids and details from the
// server never become markup.

export function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

// A table from header names and rows of cells (strings or nodes).
export function table(headers, rows) {
  const t = el('table');
  const head = t.createTHead().insertRow();
  for (const h of headers) head.appendChild(el('th', h));
  const body = t.createTBody();
  for (const row of rows) {
    const tr = body.insertRow();
    for (const cell of row) {
      const td = tr.insertCell();
      if (cell instanceof Node) td.appendChild(cell);
      else td.textContent = cell === undefined || cell === null ? '' : String(cell);
    }
  }
  return t;
}
