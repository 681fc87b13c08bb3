"""Why a session ended, and the one sentence each reason says to people.

The reasons are the vocabulary the edge and the worker share: common.proto's CloseReason
without its prefix, plus the ends only the edge tells apart (a pause or silence that lasted
too long) and the engine failure that ends a session as an `error` (error code
`inference_error`). Whoever ends a session words it with `close_message`, never with a
literal of its own: the worker in SessionEnded.message, the edge in `session.closed` (and
each dialect's equivalent). The web client's fallback texts (edge/web/js/messages.js) are
these sentences too; a test keeps them equal.

CloseReason is the enum of the reasons a session's stream carries (common.proto CloseReason
up to client_closed): the worker's session ends with one; the edge reads them as the names.
"""

from __future__ import annotations

import enum

USER_STOP = "user_stop"
TIMEOUT = "timeout"
CONTEXT_FULL = "context_full"
SERVER_SHUTDOWN = "server_shutdown"
ERROR = "error"
CLIENT_CLOSED = "client_closed"
#: Another connection resumed the session (resumable sessions).
SUPERSEDED = "superseded"
#: The edge's own: a pause (legacy `pause`), or a half-duplex call's silence, outlasted its
#: timeout (the fabric ends it as a user_stop).
PAUSE_TIMEOUT = "pause_timeout"
#: The engine failed on a unit: the session ends with `error` after error{inference_error}.
INFERENCE_ERROR = "inference_error"


class CloseReason(enum.Enum):
    """Why a session ended (common.proto CloseReason; its sentence: SENTENCES)."""

    USER_STOP = USER_STOP
    TIMEOUT = TIMEOUT
    CONTEXT_FULL = CONTEXT_FULL
    SERVER_SHUTDOWN = SERVER_SHUTDOWN
    ERROR = ERROR
    CLIENT_CLOSED = CLIENT_CLOSED


#: The sentence for each reason, addressed to the client the session belonged to.
SENTENCES = {
    USER_STOP: "You ended the session.",
    CLIENT_CLOSED: "The connection ended without closing the session, so the server closed it.",
    TIMEOUT: "The session reached its time limit.",
    CONTEXT_FULL: "Start a new session to go on: the conversation filled the model's context.",
    SERVER_SHUTDOWN: "The server is shutting down: try again in a moment.",
    ERROR: "The session ended because of an error.",
    INFERENCE_ERROR: "The model failed while answering: start a new session.",
    SUPERSEDED: "The session was resumed on another connection.",
    PAUSE_TIMEOUT: "The session went too long without input and was ended.",
}


def close_message(reason: str, detail: str = "") -> str:
    """The sentence for `reason` (an unknown one is named in a generic sentence), with
    `detail` (what exactly happened, no internals) in parentheses before its full stop."""
    text = SENTENCES.get(reason) or f"The session ended ({reason or 'no reason given'})."
    if not detail:
        return text
    return f"{text.removesuffix('.')} ({detail})."
