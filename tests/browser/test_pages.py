"""The web client in a real browser against a stack on the reference engine: the audio page
answers the fake microphone's question aloud, the chat page a typed one, the video page
sends camera frames, and the admin page shows the fabric."""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from websockets.sync.client import connect

from tests.browser.conftest import QUESTION, http_base
from tests.conftest import scaled
from tests.stack import Stack

# Reference worker start-up is part of the first test's time.
# CI's long group: a browser driving each page through a full stack, ~70 s in all.
pytestmark = [pytest.mark.timeout(scaled(180)), pytest.mark.ci_long]


def assert_clean(bp) -> None:
    """No uncaught exception, no failed request, no error event the page recorded."""
    state = bp.omni()
    assert bp.page_errors == [], f"page errors: {bp.page_errors}"
    assert bp.failed_requests == [], f"failed requests: {bp.failed_requests}"
    assert state["errors"] == [], f"window.omni.errors: {state['errors']}"


def test_landing_page_links_every_mode(stack, open_page):
    bp = open_page(f"{http_base(stack.url)}/")
    links = bp.page.eval_on_selector_all("main a", "as => as.map(a => a.getAttribute('href'))")
    assert {"/audio", "/half_duplex", "/video", "/chat", "/admin"} <= set(links), links
    bp.page.click("main a[href='/chat']")
    bp.page.wait_for_url("**/chat")
    assert bp.page_errors == [] and bp.failed_requests == [], bp.failed_requests
    bp.page.go_back()
    bp.shot()


def test_audio_page_answers_the_spoken_question(stack, open_page):
    bp = open_page(f"{http_base(stack.url)}/audio")
    bp.wait("omni => omni.state === 'idle'", "idle on load", 10)
    bp.page.click("#start")
    bp.wait("omni => omni.state === 'active'", "active", 30)
    # The microphone says the question after 3 s of silence; the reply is text and speech.
    bp.wait(
        "omni => omni.captions.length > 0 && omni.audioSamplesPlayed > 0 "
        "&& /paris/i.test(omni.captions)",
        "answered aloud with captions mentioning Paris",
        60,
    )
    bp.wait("omni => omni.phase === 'listening'", "listening again after the reply", 20)
    state = bp.omni()
    assert "Paris" in state["captions"], state["captions"]
    assert state["sessionId"] and state["unitsSent"] > 0 and state["unitsAnswered"] > 0
    assert state["audioSamplesReceived"] >= state["audioSamplesPlayed"] > 0
    assert "Paris" in bp.page.inner_text("#captions")
    # The reference engine takes units as they come (session.created's input_units): the
    # page sent the end of the question as soon as the microphone went quiet.
    assert state["cutsSpeech"] and state["unitsCut"] >= 1, state
    assert state["secondsSent"] < state["unitsSent"], state
    assert_clean(bp)
    bp.shot()
    print(
        f"captions: {state['captions']!r}; units sent {state['unitsSent']} "
        f"({state['unitsCut']} cut where speech stopped), "
        f"answered {state['unitsAnswered']}, samples played {state['audioSamplesPlayed']}"
    )
    bp.page.click("#stop")
    bp.wait("omni => omni.state === 'closed'", "closed after Stop", 15)
    assert_clean(bp)


def test_voice_call_page_answers_each_turn_aloud(stack, open_page):
    """/half_duplex: the fake microphone asks its question and pauses; the server hears the
    end of the turn, the answer streams as text and speech, the page sends nothing while it
    answers and plays, then listens again; Stop ends the call with the server's `stopped`."""
    bp = open_page(f"{http_base(stack.url)}/half_duplex")
    bp.wait("omni => omni.state === 'idle'", "idle on load", 10)
    bp.page.click("#start")
    bp.wait("omni => omni.state === 'active'", "prepared", 30)
    bp.wait(
        "omni => omni.turns.length >= 1 && /paris/i.test(omni.turns[0].text) "
        "&& omni.audioSamplesPlayed > 0",
        "the first turn answered aloud, about Paris",
        60,
    )
    bp.wait("omni => omni.phase === 'listening'", "listening again after the answer", 30)
    state = bp.omni()
    turn = state["turns"][0]
    assert turn["index"] == 1 and turn["heardMs"] > 0, turn
    assert state["chunksSent"] > 0 and state["chunksHeld"] > 0  # held while it answered
    assert "Paris" in bp.page.inner_text("#conversation")
    assert bp.page.inner_text("#turns") == str(len(state["turns"]))
    assert_clean(bp)
    bp.shot()
    bp.page.click("#stop")
    bp.wait("omni => omni.state === 'closed'", "closed after Stop", 15)
    assert bp.omni()["closeReason"] == "stopped"
    assert_clean(bp)


#: getUserMedia failing its first `window.__micFailures` calls as a busy device does
#: (NotReadableError), then the browser's own; `window.__micCalls` counts the calls.
BUSY_MICROPHONE = """
window.__micCalls = 0;
const realGetUserMedia = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (constraints) => {
  window.__micCalls += 1;
  if (window.__micCalls <= FAILURES) {
    throw new DOMException('Could not start audio source', 'NotReadableError');
  }
  return realGetUserMedia(constraints);
};
"""


@pytest.mark.parametrize("failures", [1, 3])
def test_a_busy_microphone_is_asked_again_then_reported(stack, open_page, failures):
    """A microphone that will not start at once (another program releasing it) is asked
    again twice; one that stays busy is reported with the page's sentence for it."""
    bp = open_page(
        f"{http_base(stack.url)}/half_duplex",
        init_script=BUSY_MICROPHONE.replace("FAILURES", str(failures)),
    )
    bp.wait("omni => omni.state === 'idle'", "idle on load", 10)
    bp.page.click("#start")
    if failures < 3:
        bp.wait("omni => omni.chunksSent > 0", "sending the microphone after a retry", 30)
        assert bp.page.evaluate("() => window.__micCalls") == failures + 1
        assert_clean(bp)
        bp.page.click("#stop")
        bp.wait("omni => omni.state === 'closed'", "closed after Stop", 15)
    else:
        bp.wait("omni => omni.errors.length > 0", "reporting the microphone", 30)
        assert bp.page.evaluate("() => window.__micCalls") == 3
        assert bp.omni()["errors"] == [
            "The microphone is in use by another program or could not be opened."
        ]
    bp.shot()


def test_chat_page_answers_a_typed_question(stack, open_page):
    bp = open_page(f"{http_base(stack.url)}/chat")
    bp.page.fill("#text", QUESTION)
    bp.page.click("#send")
    bp.wait(
        "omni => omni.turns.length > 0 && omni.turns[omni.turns.length - 1].done",
        "done with the turn",
        60,
    )
    state = bp.omni()
    turn = state["turns"][-1]
    assert turn["user"] == QUESTION
    assert "Paris" in turn["assistant"], turn
    assert "Paris" in bp.page.inner_text("#transcript")
    assert_clean(bp)
    bp.shot()


def test_video_page_sends_frames_and_is_answered(stack, open_page):
    bp = open_page(f"{http_base(stack.url)}/video")
    bp.page.click("#start")
    bp.wait("omni => omni.state === 'active'", "active", 30)
    # One JPEG per second from chromium's fake camera; the reference engine ignores frames.
    bp.wait(
        "omni => omni.framesSent > 0 && omni.unitsAnswered >= 2",
        "sending frames with units answered",
        30,
    )
    state = bp.omni()
    assert state["unitsSent"] >= state["unitsAnswered"] >= 2
    assert_clean(bp)
    bp.shot()
    bp.page.click("#stop")
    bp.wait("omni => omni.state === 'closed'", "closed after Stop", 15)


@contextmanager
def held_session(url: str) -> Iterator[str]:
    """A running audio session from a plain client, two units sent; yields its id."""
    with connect(f"{url}?mode=audio", subprotocols=["map.realtime"], compression=None) as ws:
        deadline = time.monotonic() + scaled(30)

        def until(kind: str) -> dict:
            while True:
                event = json.loads(ws.recv(timeout=max(0.01, deadline - time.monotonic())))
                if event["type"] == kind:
                    return event

        until("session.queue_done")
        ws.send(json.dumps({"type": "session.init", "payload": {}}))
        created = until("session.created")
        audio = base64.b64encode(np.zeros(16000, "<f4").tobytes()).decode()
        for _ in range(2):
            ws.send(json.dumps({"type": "input.append", "input": {"audio": audio}}))
        yield created["session_id"]


def test_admin_page_shows_the_worker_and_a_running_session(stack, open_page):
    with held_session(stack.url) as session_id:
        bp = open_page(f"{http_base(stack.url)}/admin")
        bp.wait(
            "omni => omni.state === 'ok' && omni.status.workers.some(w => w.worker_id === "
            f"'worker0') && omni.status.sessions.some(s => s.session_id === '{session_id}' "
            "&& s.units >= 2)",
            "showing worker0 and the held session with its units",
            15,
        )
        workers = bp.page.inner_text("#workers")
        assert "worker0" in workers and "reference" in workers and "serving" in workers
        sessions = bp.page.inner_text("#sessions")
        assert session_id in sessions and "audio" in sessions
        assert "queued" in bp.page.inner_text("#queue")
        assert bp.page_errors == []
        bp.shot()
    # The page refreshes by itself: the ended session leaves the table.
    bp.wait(
        f"omni => omni.state === 'ok' && !omni.status.sessions.some(s => s.session_id === "
        f"'{session_id}')",
        "refreshed without the closed session",
        10,
    )
    assert session_id not in bp.page.inner_text("#sessions")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_admin_page_explains_401_and_503_and_keys_work_from_a_browser(stack, open_page, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-browser-admin\n")
    keyed = Stack(tmp_path / "keyed")
    keyed.log_dir.mkdir()
    keyed.scheduler_address = stack.scheduler_address
    orphan = Stack(tmp_path / "orphan")
    orphan.log_dir.mkdir()
    orphan.scheduler_address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    try:
        keyed.start_edge("--api-keys-file", str(keys))
        orphan.start_edge()
        # Keys on: the page loads without one, and says /status needs one.
        bp = open_page(f"{http_base(keyed.url)}/admin", name="admin_401")
        bp.wait("omni => omni.state === 'unauthorized'", "asking for a key", 10)
        assert "API key" in bp.page.inner_text("#status")
        bp.shot()
        # With the key typed in, the same page shows the fabric (and keeps the key).
        bp.page.fill("#apikey", "sk-browser-admin")
        bp.page.click("#refresh")
        bp.wait("omni => omni.state === 'ok'", "showing the status with the key", 10)
        assert "worker0" in bp.page.inner_text("#workers")
        assert bp.page.evaluate("() => localStorage.getItem('omni.apiKey')") == "sk-browser-admin"
        # A browser WebSocket with the key as a `bearer.` subprotocol is let in and gets
        # map.realtime back; an unknown key is refused before the upgrade.
        opened = bp.page.evaluate(
            """async ([url, key]) => await new Promise(resolve => {
                 const ws = new WebSocket(url, ["map.realtime", "bearer." + key]);
                 ws.onopen = () => { resolve(ws.protocol); ws.close(); };
                 ws.onerror = () => resolve("refused");
               })""",
            [f"{keyed.url}?mode=chat", "sk-browser-admin"],
        )
        assert opened == "map.realtime"
        wrong = bp.page.evaluate(
            """async ([url, key]) => await new Promise(resolve => {
                 const ws = new WebSocket(url, ["map.realtime", "bearer." + key]);
                 ws.onopen = () => { resolve(ws.protocol); ws.close(); };
                 ws.onerror = () => resolve("refused");
               })""",
            [f"{keyed.url}?mode=chat", "sk-not-a-key"],
        )
        assert wrong == "refused"
        # The voice call page with the key typed in: its call is let in and prepared.
        call = open_page(f"{http_base(keyed.url)}/half_duplex", name="voice_call_keyed")
        call.page.fill("#apikey", "sk-browser-admin")
        call.page.click("#start")
        call.wait("omni => omni.state === 'active'", "prepared with the key", 30)
        call.page.click("#stop")
        call.wait("omni => omni.state === 'closed'", "closed after Stop", 15)
        assert call.omni()["closeReason"] == "stopped" and call.omni()["errors"] == []
        # An edge that cannot reach its scheduler: the page says so instead of going blank.
        down = open_page(f"{http_base(orphan.url)}/admin", name="admin_503")
        down.wait("omni => omni.state === 'unavailable'", "reporting the scheduler down", 15)
        assert "scheduler" in down.page.inner_text("#status")
        down.shot()
        assert bp.page_errors == [] and down.page_errors == []
        assert keyed.edge is not None
        assert "sk-browser-admin" not in keyed.edge.log_path.read_text()
    finally:
        keyed.stop()
        orphan.stop()


def test_a_switched_off_app_is_marked_on_the_pages(stack, open_page):
    """PUT /api/admin/apps/omni {enabled: false}: the landing page strikes the video link
    (so does every page's navigation), the video page says so before anyone starts;
    switched back on, both are plain again."""
    from tests.edge.test_voices import request

    base = http_base(stack.url)
    assert request(f"{base}/api/admin/apps/omni", "PUT", {"enabled": False})[0] == 200
    try:
        bp = open_page(f"{base}/")
        bp.page.wait_for_selector("main a.switched-off[href='/video']")
        assert bp.page.eval_on_selector_all("a.switched-off", "as => as.length") >= 1
        video = open_page(f"{base}/video")
        notice = video.page.wait_for_selector("#switched-off")
        assert "switched this kind of session off" in notice.inner_text()
        assert video.page_errors == [] and bp.page_errors == []
        # The navigation every page shares strikes it too, on the admin page as well.
        admin = open_page(f"{base}/admin")
        admin.page.wait_for_selector("#site-nav a.switched-off[href='/video']")
        assert admin.page_errors == []
        bp.shot()
    finally:
        request(f"{base}/api/admin/apps/omni", "PUT", {"enabled": True})
    audio = open_page(f"{base}/audio")
    audio.page.wait_for_load_state("networkidle")
    assert audio.page.query_selector("#switched-off") is None


def test_viewer_plays_back_a_recorded_session(stack, open_page):
    """A recorded audio session at /s/<id>: its facts, both audio tracks loaded, one table
    row and one plotted bar per unit."""
    import asyncio
    import concurrent.futures

    from tests.e2e.wsclient import SILENCE, SPEECH, WsClient

    async def record() -> str:
        client = await WsClient.open(f"{stack.url}?mode=audio")
        created = await client.start(prompt="be brief")
        for samples in (SPEECH, SILENCE):
            await client.append(samples)
            await client.until("delta.listen", "delta.speak", timeout_s=30)
        await client.send({"type": "session.close"})
        await client.until("session.closed")
        await client.close()
        return created["session_id"]

    # Playwright's sync API holds this thread's event loop: the client runs in its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sid = pool.submit(asyncio.run, record()).result()
    bp = open_page(f"{http_base(stack.url)}/s/{sid}")
    bp.wait("omni => omni.loaded || omni.error", "loaded", 30)
    state = bp.omni()
    assert state["error"] is None and state["units"] == 2, state
    assert "user" in state["audio"]
    assert bp.page.eval_on_selector_all("#units tbody tr", "rows => rows.length") == 2
    assert "be brief" in bp.page.inner_text("#meta")
    assert bp.page_errors == [] and bp.failed_requests == [], bp.failed_requests
    bp.shot()
    missing = open_page(f"{http_base(stack.url)}/s/no_such_session")
    missing.wait("omni => omni.error", "an error", 15)
    assert "no recorded session" in missing.omni()["error"]


def test_admin_operator_tools(stack, open_page, tmp_path):
    """The admin page's operator tools act through the edge's API: an app switched off and
    on, a voice uploaded from a WAV file and deleted, the wait estimate saved; the presets
    and the recorded sessions (with viewer links) listed; the plot fed every refresh."""
    import io
    import wave

    import numpy as np

    from tests.edge.test_voices import request

    base = http_base(stack.url)
    bp = open_page(f"{base}/admin")
    bp.wait("omni => omni.ops.apps && omni.ops.eta && omni.ops.presets", "tools loaded", 15)
    assert "Voice call" in bp.page.inner_text("#ops-presets")

    bp.page.click("#ops-apps tr:has-text('/video') button")
    bp.wait("omni => omni.ops.apps.some(a => a.app_id === 'omni' && !a.enabled)", "omni off", 10)
    assert request(f"{base}/api/apps", "GET")[1]["apps"][1]["app_id"] != "omni"
    bp.page.click("#ops-apps tr:has-text('/video') button")
    bp.wait("omni => omni.ops.apps.every(a => a.enabled)", "omni back on", 10)

    wav = tmp_path / "anna.wav"
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((0.2 * np.sin(np.arange(16000) / 8) * 32767).astype("<i2").tobytes())
    wav.write_bytes(buf.getvalue())
    bp.page.fill("#ops-voices input[name=name]", "Anna")
    bp.page.set_input_files("#ops-voices input[type=file]", str(wav))
    bp.page.click("#ops-voices button[type=submit]")
    bp.wait("omni => (omni.ops.voices || []).some(v => v.name === 'Anna')", "voice listed", 10)
    bp.page.click("#ops-voices tr:has-text('Anna') button")
    bp.wait("omni => !omni.ops.voices.some(v => v.name === 'Anna')", "voice deleted", 10)

    bp.page.fill("#ops-eta-form input[name=eta_chat_s]", "7")
    bp.page.click("#ops-eta-form button[type=submit]")
    bp.wait("omni => omni.ops.eta && omni.ops.eta.config.eta_chat_s === 7", "estimate saved", 10)
    assert request(f"{base}/api/config/eta", "GET")[1]["config"]["eta_chat_s"] == 7
    assert bp.omni()["ops"]["lastAction"]["isError"] is False
    assert bp.page_errors == [] and bp.failed_requests == [], bp.failed_requests
    bp.shot()


def test_admin_page_says_why_a_remote_operator_is_refused(open_page, tmp_path):
    """An edge without keys on 0.0.0.0, its admin page opened through this machine's
    non-loopback address: the apps list and a saved wait estimate show the 403's sentence
    (operator endpoints answer only clients on loopback) instead of acting."""
    from tests.e2e.test_operator_access import LOOPBACK_ONLY, lan_address

    lan = lan_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback address a local client can reach")
    remote = Stack(tmp_path)
    try:
        remote.start_scheduler()
        remote.start_edge("--host", "0.0.0.0")
        port = remote.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
        bp = open_page(f"http://{lan}:{port}/admin")
        bp.wait("omni => omni.ops.eta", "the wait estimate loaded", 15)
        bp.page.wait_for_selector(f"#ops-apps :text('{LOOPBACK_ONLY[:40]}')")
        bp.page.fill("#ops-eta-form input[name=eta_chat_s]", "7")
        bp.page.click("#ops-eta-form button[type=submit]")
        bp.wait("omni => omni.ops.lastAction", "the save answered", 10)
        action = bp.omni()["ops"]["lastAction"]
        assert action["isError"] is True and LOOPBACK_ONLY in action["text"], action
        assert LOOPBACK_ONLY in bp.page.inner_text("#ops-message")
        assert bp.page_errors == []
        bp.shot()
    finally:
        remote.stop()


def test_the_page_reconnects_when_its_edge_is_replaced(open_page, tmp_path):
    """The edge dies mid-session and a new one comes up at the same address: the page says
    it is reconnecting, resumes the session by itself and goes on (no error shown)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "1", "--compute-ms", "5")
        args = ("--port", str(port), "--resume-window", "20")
        edge = stack.start_edge(*args, name="edge-a")
        bp = open_page(f"{http_base(stack.url)}/audio")
        bp.page.click("#start")
        bp.wait("omni => omni.state === 'active' && omni.unitsAnswered >= 2", "active", 30)
        session_id = bp.omni()["sessionId"]
        edge.kill()
        edge.proc.wait()
        bp.wait("omni => omni.reconnecting", "reconnecting shown", 10)
        assert "reconnecting" in bp.page.inner_text("#status").lower()
        stack.start_edge(*args, name="edge-b")
        bp.wait("omni => omni.resumes === 1 && !omni.reconnecting", "resumed", 20)
        answered = bp.omni()["unitsAnswered"]
        bp.wait(f"omni => omni.unitsAnswered >= {answered + 2}", "units answered again", 15)
        state = bp.omni()
        assert state["state"] == "active" and state["sessionId"] == session_id
        assert "reconnected" in bp.page.inner_text("#status").lower()
        assert bp.page_errors == [] and state["errors"] == [], state["errors"]
        bp.shot()
        bp.page.click("#stop")
        bp.wait("omni => omni.state === 'closed'", "closed after Stop", 15)
    finally:
        stack.stop()
