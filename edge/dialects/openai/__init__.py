"""The OpenAI Realtime API (its GA form, as the `openai` Python SDK 3.x speaks it) on
/v1/realtime?model=..., so clients written for it talk to omnifabric unchanged.

`AsyncOpenAI(base_url="http://HOST:PORT/v1", api_key=KEY).realtime.connect(model=M)` opens
`ws://HOST:PORT/v1/realtime?model=M` with `Authorization: Bearer KEY` (browsers offer the
`realtime` and `openai-insecure-api-key.KEY` subprotocols instead). The MiniCPM-o protocol
on the same path always names its `mode=`; a URL with `model=` and no `mode=` is this one.

How the protocol maps onto the fabric:
- `session.created` goes out on connect; `session.update` is answered by `session.updated`.
  What the engine cannot honour (tools, a transcription model, noise reduction, a speed,
  an unregistered voice, ...) is said once, as an `error` of type `invalid_request_error`
  with code `unsupported_parameter` and its `param`; the session goes on.
- With turn detection on (`server_vad`, the default, or `semantic_vad`) the conversation
  is a full-duplex session of the engine: the first `input_audio_buffer.append` queues it
  for a worker (nothing is sent while it waits: the queue API shows the position) and
  starts it with the session's settings. The client's audio (24 kHz PCM16, or 8 kHz G.711)
  goes to the driver's paced cadence (edge.cadence): cut into the worker's units (1 s) and
  sent one at a time, the next when the last one was answered; when the client sends less
  than real time (it stopped streaming, or pauses) the rest of the second is silence, so
  the session's clock never stops and a reply never waits for more input. The engine's
  own turn-taking drives the events: `speech_started` (input louder than the half-duplex
  call's speech level), then, when the engine starts to answer, `speech_stopped`,
  `committed`, the user item (with what the engine heard as its transcript, when it
  says), and the response's events; speech heard during a reply that then stops ends it
  `cancelled` (`turn_detected`).
- With turn detection null, turns are the client's: `commit` makes a user item of the
  buffer, `conversation.item.create` adds text, audio or image items, `response.create`
  answers the conversation as one chat turn (edge.chat: a worker slot for the turn only,
  the conversation kept here), with per-response instructions, modalities and token cap.
  A text item and `response.create` work the same way before any audio in a session with
  turn detection on; once its duplex session runs, replies are the engine's to make.
- Errors have OpenAI's shape; a malformed or unknown event gets one and the session goes on.

The package: `translator` (the dialect), `settings` (session.update), `conversation`
(items and the chat input of a response on request), `responses` (a response's events),
`duplex` (the engine's turn-taking as the API's events), `audio` (formats) and `wire`
(ids, errors, notices, usage).
"""

from omnifabric.edge.dialects.openai.audio import decode_audio, encode_audio
from omnifabric.edge.dialects.openai.translator import OpenAIRealtime

__all__ = ["OpenAIRealtime", "decode_audio", "encode_audio"]
