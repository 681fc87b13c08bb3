"""common/children.py: the supervisors' stop request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from omnifabric.common.children import StopRequest


@pytest.fixture(autouse=True)
def _restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_during_wait_ends_it():
    for signum in (signal.SIGINT, signal.SIGTERM):
        stop = StopRequest()
        stop.install()
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()
        started = time.monotonic()
        assert stop.wait(60.0) is True
        assert time.monotonic() - started < 30.0


def test_wait_times_out_without_a_signal_and_the_handler_needs_no_lock():
    stop = StopRequest()
    stop.install()
    assert stop.wait(0.1) is False
    # What the handler does must be safe whatever the main thread holds: it only assigns.
    handler = signal.getsignal(signal.SIGINT)
    assert callable(handler)
    handler(signal.SIGINT, None)
    assert stop.requested and stop.wait(0.0) is True


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    """What a supervisor that does not stop is doing: SIGUSR1 dumps the stacks (to stderr)
    without stopping it; SIGTERM then still ends it."""
    # 'up' once the main thread is inside wait (a loaded machine may otherwise signal it
    # between the print and the wait, and the dump shows the print's line)
    code = (
        "import sys, threading, time\n"
        "from omnifabric.common.children import StopRequest\n"
        "s = StopRequest(); s.install()\n"
        "def up():\n"
        "    main = threading.main_thread().ident\n"
        "    while True:\n"
        "        f = sys._current_frames().get(main)\n"
        "        while f is not None and f.f_code.co_name != 'wait':\n"
        "            f = f.f_back\n"
        "        if f is not None:\n"
        "            return print('up', flush=True)\n"
        "        time.sleep(0.01)\n"
        "threading.Thread(target=up, daemon=True).start()\n"
        "print('stopped' if s.wait(60) else 'timed out', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # still running
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out.strip() == "stopped"
    assert "most recent call first" in err and "in wait" in err, err
