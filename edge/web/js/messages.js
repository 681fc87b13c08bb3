// Sentences for people: every error code, session.closed reason and WebSocket close
// code the server can send, so a page never shows a bare code. A close reason's sentence
// is the server's (common/close_reasons.py, which the server sends as `message`): the
// copies here word the closes that come without one, and a test keeps them equal.

/** `error` event codes (README "Errors" table) -> what happened, for a person. */
export const ERROR_TEXTS = {
  not_ready: 'The page sent audio before the session was ready. Audio sent too early was ignored.',
  invalid_event: 'The page sent a request the server does not accept at this point.',
  unknown_event: 'The page sent a request the server does not know.',
  missing_field: 'The page sent a request with a missing field.',
  invalid_payload: 'The server could not use what the page sent (audio, image or settings).',
  inference_error: 'The model failed while answering: start a new session.',
  queue_full: 'The server is full and its waiting line is too: try again in a few minutes.',
  service_unavailable: 'No model is available right now: try again later.',
  worker_busy: 'All model servers are busy: try again shortly.',
  worker_connect_failed: 'The server could not reach the model: try again shortly.',
  slow_client: 'The connection was too slow to receive the replies, so the server ended the session.',
  internal_error: 'The server hit an internal error.',
  too_many_sessions: 'This API key already holds as many sessions as it may, counting every server of the service: close one and try again.',
  app_disabled: 'The operator has switched this kind of session off for now: try again later.',
  cancelled: 'An operator removed your request from the waiting line.',
};

/** session.closed reasons -> why the session ended, for a person (the server's sentences). */
export const CLOSE_REASON_TEXTS = {
  user_stop: 'You ended the session.',
  stopped: 'You ended the session.',
  client_closed: 'The connection ended without closing the session, so the server closed it.',
  timeout: 'The session reached its time limit.',
  context_full: 'Start a new session to go on: the conversation filled the model\'s context.',
  server_shutdown: 'The server is shutting down: try again in a moment.',
  error: 'The session ended because of an error.',
  backend_error: 'The session ended because of an error.',
  superseded: 'The session was resumed on another connection.',
  pause_timeout: 'The session went too long without input and was ended.',
};

/** WebSocket close codes -> what they mean, for a person (RFC 6455 section 7.4). */
export const CLOSE_CODE_TEXTS = {
  1000: 'The connection was closed normally.',
  1001: 'The server is going away (restarting or shutting down).',
  1003: 'The server could not read a message from this page.',
  1005: 'The connection was closed without a reason.',
  1006: 'The connection failed or was lost. The server may be unreachable, or it refused '
    + 'the connection: check the API key, and whether this key already has too many '
    + 'sessions open.',
  1007: 'The server could not read a message from this page (it was not valid text).',
  1008: 'The server ended the connection because of how this page used it.',
  1009: 'A message from this page was too large for the server.',
  1011: 'The server ended the connection after an unexpected condition (or it stopped hearing from this page).',
  1012: 'The server is restarting.',
  1013: 'The server is overloaded: try again later.',
  1015: 'The secure connection (TLS) to the server failed.',
};

/** The sentence for an `error` event; the server's own message is added as detail. */
export function errorText(code, message) {
  const text = ERROR_TEXTS[code] || `The server reported an error (${code || 'unknown'}).`;
  return message && message !== text ? `${text} (${message})` : text;
}

/**
 * The sentence for a session.closed: the server's `message` (the reason's one sentence,
 * with what exactly happened) when it sent one, else the reason's sentence from the table
 * (the reason itself when unknown).
 */
export function closedText(reason, message) {
  if (message) return message;
  return CLOSE_REASON_TEXTS[reason] || `The session ended (${reason || 'no reason given'}).`;
}

/**
 * The sentence for a WebSocket close the session did not announce. The close reason may
 * be an error code or close reason of the protocol; those get their own sentence.
 */
export function socketCloseText(code, reason) {
  if (reason && ERROR_TEXTS[reason]) return ERROR_TEXTS[reason];
  if (reason && CLOSE_REASON_TEXTS[reason]) return CLOSE_REASON_TEXTS[reason];
  const text = CLOSE_CODE_TEXTS[code] || `The connection closed (code ${code}).`;
  return reason ? `${text} (${reason})` : text;
}

/** The sentence for a failed getUserMedia, by the DOMException's name. */
export function mediaErrorText(err, what = 'microphone') {
  const name = err && err.name;
  if (name === 'NotAllowedError' || name === 'SecurityError') {
    return `Permission to use the ${what} was refused. Allow it in the browser's site settings and try again.`;
  }
  if (name === 'NotFoundError' || name === 'OverconstrainedError') {
    return `No ${what} was found. Connect one and try again.`;
  }
  if (name === 'NotReadableError' || name === 'AbortError') {
    return `The ${what} is in use by another program or could not be opened.`;
  }
  if (name === 'InsecureContext') {
    return `The ${what} is only available on a secure page: open this page over https or from localhost.`;
  }
  return `The ${what} could not be started${err && err.message ? ` (${err.message})` : ''}.`;
}
