"""Every close reason has one sentence, written once (common.close_reasons): the worker and
the edge word closes with it, and the web client's fallback texts are the same sentences."""

from __future__ import annotations

import re

from omnifabric.common import close_reasons
from omnifabric.common.close_reasons import SENTENCES, close_message
from omnifabric.omni.realtime.v1 import common_pb2
from tests.conftest import ROOT

#: The proto's reasons by name, the edge's own, and the engine failure's error code.
REASONS = [
    *(
        name.removeprefix("CLOSE_REASON_").lower()
        for name in common_pb2.CloseReason.keys()
        if name != "CLOSE_REASON_UNSPECIFIED"
    ),
    close_reasons.PAUSE_TIMEOUT,
    close_reasons.INFERENCE_ERROR,
]


def test_every_reason_has_its_own_sentence():
    assert sorted(SENTENCES) == sorted(REASONS)
    for reason in REASONS:
        sentence = close_message(reason)
        assert sentence == SENTENCES[reason] and sentence.endswith("."), reason
        assert sentence[0].isupper(), reason
    assert len(set(SENTENCES.values())) == len(SENTENCES)
    # The client's stop is the only one that says the client ended the session.
    assert [r for r, s in SENTENCES.items() if s.startswith("You ended")] == ["user_stop"]
    assert "shutting down" in SENTENCES[close_reasons.SERVER_SHUTDOWN]


def test_a_detail_goes_inside_the_sentence_and_an_unknown_reason_is_named():
    assert close_message("error", "the worker was lost") == (
        "The session ended because of an error (the worker was lost)."
    )
    assert close_message("martian") == "The session ended (martian)."
    assert close_message("") == "The session ended (no reason given)."


def js_table(source: str, name: str) -> dict[str, str]:
    """`export const NAME = { key: 'text', ... };` of a JS module -> {key: text}."""
    body = re.search(rf"export const {name} = \{{(.*?)\n\}};", source, re.S)
    assert body is not None, name
    entries = re.findall(r"^\s*(\w+): '((?:[^'\\]|\\.)*)',", body.group(1), re.M)
    return {key: text.replace("\\'", "'") for key, text in entries}


def test_the_web_client_says_the_same_sentence_for_each_reason():
    """messages.js words what the server sends no message for (a stop, a full context, a
    socket closed with a reason name) with these very sentences."""
    source = (ROOT / "edge" / "web" / "js" / "messages.js").read_text()
    texts = js_table(source, "CLOSE_REASON_TEXTS")
    aliases = {"stopped": close_reasons.USER_STOP, "backend_error": close_reasons.ERROR}
    for key, text in texts.items():
        assert text == SENTENCES[aliases.get(key, key)], key
    assert set(SENTENCES) - {close_reasons.INFERENCE_ERROR} <= set(texts)
    errors = js_table(source, "ERROR_TEXTS")
    assert errors["inference_error"] == SENTENCES[close_reasons.INFERENCE_ERROR]


def test_the_services_write_no_close_sentence_of_their_own():
    """The sentences (and the old per-site wordings) appear nowhere but in the table."""
    words = [*SENTENCES.values(), "closed by the client", "the server is shutting down"]
    for folder in ("edge", "worker"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text().lower()
            for sentence in words:
                assert sentence.lower() not in text, f"{path}: {sentence!r}"
