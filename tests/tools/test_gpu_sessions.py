"""tools.gpu_sessions on CPU: the reference engine, two sessions, table and JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnifabric.tools import gpu_sessions
from tests.conftest import ROOT, scaled


# The global 120 s (unscaled) would cut short the command's own scaled(120) s.
@pytest.mark.long
@pytest.mark.timeout(scaled(300))
def test_two_sessions_on_cpu(tmp_path: Path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "omnifabric.tools.gpu_sessions", "--engine", "reference"]
    cmd += ["--device", "cpu", "--sessions", "2", "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(120), check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ran on CPU" in proc.stdout
    assert "p50 ms" in proc.stdout and "d_base" in proc.stdout

    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["memory_measure"] == "rss"
    assert report["leak_checked"] is False  # RSS is reported, not held to the tolerance
    assert report["baseline_bytes"] > 0
    sessions = report["sessions"]
    assert [s["session"] for s in sessions] == [1, 2]
    for s in sessions:
        assert s["units"] == report["units_per_session"] == s["listen"] + s["speak"]
        assert s["speak"] > 0 and "Paris" in s["text"]
        c = s["compute_ms"]
        assert 0 < c["p50"] <= c["p99"] <= c["max"]
        m = s["memory"]
        for key in ("before", "after_close", "after_cleanup"):
            assert m[f"{key}_bytes"] > 0
            assert m[f"{key}_vs_baseline_bytes"] == m[f"{key}_bytes"] - report["baseline_bytes"]
        assert m["peak_bytes"] is None  # CUDA only
    # Same input, same greedy reply: the second session is not disturbed by the first.
    assert sessions[0]["text"] == sessions[1]["text"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_fails_clearly(capsys):
    assert gpu_sessions.main(["--device", "cuda", "--sessions", "1"]) == 2
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err


def test_batched_mode_compares_steps_with_time_slicing(tmp_path: Path, capsys):
    """--batched on the synthetic engine (a step of N costs 1 + 0.1 x (N - 1) units'
    compute): per N both modes, the same replies per session, the ratio and the verdicts."""
    out = tmp_path / "batched.json"
    argv = ["--engine", "synthetic", "--device", "cpu", "--batched", "1,4", "--units", "3"]
    assert gpu_sessions.main([*argv, "--batch-share", "0.1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batched/time-sliced units per second" in printed and "largest N" in printed
    report = json.loads(out.read_text())
    runs = {(r["sessions"], r["mode"]): r for r in report["runs"]}
    assert set(runs) == {(n, m) for n in (1, 4) for m in ("batched", "time-sliced")}
    for n in (1, 4):
        batched, sliced = runs[(n, "batched")], runs[(n, "time-sliced")]
        assert batched["texts"] == sliced["texts"] and len(batched["texts"]) == n
        assert batched["units"] == sliced["units"] == 3 * n
        assert set(batched["phases_ms_per_step"]) >= {"prefill", "generate"}
    # Four rows in one step cost 1.3 units' compute against 4 one by one.
    ratio = runs[(4, "batched")]["units_per_s"] / runs[(4, "time-sliced")]["units_per_s"]
    assert ratio > 1.5, ratio


def test_warmup_units_run_untimed_and_each_run_is_written_as_it_ends(tmp_path: Path, capsys):
    """--warmup-units 2: each session runs 2 units before the timed ones (their rounds' ms
    apart, the timed units the same as without them); the JSON holds every run ended so far
    after each run, so a time limit keeps them."""
    out = tmp_path / "warm.json"
    argv = ["--engine", "synthetic", "--device", "cpu", "--batched", "1,2", "--units", "3"]
    argv += ["--batch-share", "0.1", "--modes", "batched", "--json", str(out)]
    written = []
    real = gpu_sessions._write_json

    def spy(path, report, quiet=False):
        real(path, report, quiet)
        written.append(
            [(r["sessions"], len(r["warmup_ms"])) for r in json.loads(out.read_text())["runs"]]
        )

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gpu_sessions, "_write_json", spy)
        assert gpu_sessions.main([*argv, "--warmup-units", "2"]) == 0
    assert written == [[(1, 2)], [(1, 2), (2, 2)], [(1, 2), (2, 2)]]
    printed = capsys.readouterr().out
    assert "N=2 batched:" in printed and "(warm-up " in printed
    report = json.loads(out.read_text())
    assert report["warmup_units"] == 2
    for run in report["runs"]:
        assert run["units"] == 3 * run["sessions"] and all(ms > 0 for ms in run["warmup_ms"])
    assert not list(tmp_path.glob("*.part"))
    assert gpu_sessions.main([*argv, "--warmup-units", "-1"]) == 2
    assert "--warmup-units must be >= 0" in capsys.readouterr().err


def test_a_failed_run_is_reported_and_the_next_runs_still_made(tmp_path: Path, capsys):
    """One run raising (out of memory, say) is a line and an entry of the JSON's `failed`;
    the other counts and modes run, the table has them, the exit status is 1."""
    from omnifabric.tools import batched

    out = tmp_path / "failed.json"
    argv = ["--engine", "synthetic", "--device", "cpu", "--batched", "4,2", "--units", "2"]
    argv += ["--batch-share", "0.1", "--modes", "batched,time-sliced", "--json", str(out)]
    real = batched.run

    def run(engine, stepper, mode, n, *args, **kwargs):
        if (n, mode) == (4, "batched"):
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return real(engine, stepper, mode, n, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(batched, "run", run)
        assert gpu_sessions.main(argv) == 1
    printed = capsys.readouterr().out
    assert "N=4 batched: failed: RuntimeError: CUDA out of memory (a stand-in)" in printed
    assert "loaded in " in printed and ", warm-up " in printed
    report = json.loads(out.read_text())
    assert report["failed"] == [
        {"sessions": 4, "mode": "batched", "error": "RuntimeError: CUDA out of memory (a stand-in)"}
    ]
    ran = [(r["sessions"], r["mode"]) for r in report["runs"]]
    assert ran == [(4, "time-sliced"), (2, "batched"), (2, "time-sliced")]
    assert report["load_s"] >= 0 and report["warmup_s"] >= 0


def test_a_reply_open_after_the_warm_up_has_no_first_audio_in_the_figures():
    from types import SimpleNamespace

    import numpy as np

    from omnifabric.tools import batched

    def unit(listen: bool, samples: int, end: bool = False) -> SimpleNamespace:
        return SimpleNamespace(is_listen=listen, audio=np.zeros(samples), end_of_turn=end)

    speech = batched._Speech(3, 1.0)
    speech.before(0, unit(False, 24000))  # speaking when the timed units start
    speech.before(1, unit(False, 24000, True))  # its reply ended in the warm-up
    speech.before(2, unit(True, 24000))  # listening
    for i in range(3):
        speech.add(i, 0, unit(False, 24000), 0.2)
    assert speech.first_audio_s == [0.2, 0.2] and speech.seconds == 3.0


def test_batched_mode_refuses_bad_counts(capsys):
    assert gpu_sessions.main(["--engine", "synthetic", "--device", "cpu", "--batched", "0,2"]) == 2
    assert "positive session counts" in capsys.readouterr().err


def test_speech_figures_count_audio_gaps_and_first_audio():
    """A reply's first unit without audio is a gap and delays its first audio by a unit; a
    short unit that ends its turn is no gap; listening units carry no speech."""
    from types import SimpleNamespace

    import numpy as np

    from omnifabric.tools import batched

    def unit(listen: bool, samples: int, end: bool = False) -> SimpleNamespace:
        audio = np.zeros(samples, np.float32)
        return SimpleNamespace(is_listen=listen, audio=audio, end_of_turn=end)

    speech = batched._Speech(2, 1.0)
    speech.add(0, 0, unit(True, 24000), 0.1)  # listening: its second of silence is no speech
    speech.add(0, 1, unit(False, 0), 0.2)  # the reply starts without audio: a gap
    speech.add(0, 2, unit(False, 24000), 0.3)  # first audio a unit later: 1 s + 0.3 s
    speech.add(0, 3, unit(False, 12000, True), 0.1)  # short, but it ends the turn
    speech.add(1, 0, unit(False, 24000), 0.25)  # another session's reply: audio at once
    figures = speech.figures(2.0)
    assert figures["audio_gaps"] == 1
    assert figures["audio_s"] == 2.5 and figures["audio_s_per_s"] == 1.25
    assert figures["first_audio_ms"]["replies"] == 2
    assert sorted(speech.first_audio_s) == [0.25, 1.3]


def test_serial_vocoder_mode_runs_where_the_engine_has_no_choice(tmp_path: Path):
    """--modes batched,serial-vocoder on the synthetic engine (no vocoder to switch): both
    run, with the speech columns filled."""
    out = tmp_path / "modes.json"
    argv = ["--engine", "synthetic", "--device", "cpu", "--batched", "2", "--units", "3"]
    argv += ["--batch-share", "0.1", "--modes", "batched,serial-vocoder", "--json", str(out)]
    assert gpu_sessions.main(argv) == 0
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"batched", "serial-vocoder"}
    for run in runs.values():
        assert run["audio_gaps"] >= 0 and run["audio_s"] >= 0
        assert run["vocoder_cache_mib_per_session"] is None  # the synthetic engine has none


def test_eager_mode_and_profile_run_on_any_engine(tmp_path: Path, capsys):
    """--modes batched,batched-eager,batched-in-step and --profile on the synthetic engine
    (no decode to switch, no phases marked, no GPU): the modes run, a trace is written and
    the report says no kernels were recorded."""
    out = tmp_path / "profile.json"
    argv = ["--engine", "synthetic", "--device", "cpu", "--batched", "2", "--units", "2"]
    argv += ["--batch-share", "0.1", "--modes", "batched,batched-eager,batched-in-step"]
    assert gpu_sessions.main([*argv, "--profile", str(tmp_path / "trace"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA kernels recorded" in printed
    report = json.loads(out.read_text())
    assert {r["mode"] for r in report["runs"]} == {"batched", "batched-eager", "batched-in-step"}
    decode = [line for line in report["summary"] if line.startswith("N=2: decode ms per step")]
    assert len(decode) == 2 and " vs in step " in decode[1], decode
    profiled = report["profile"]
    assert profiled["gpu_measured"] is False and profiled["sessions"] == 2
    assert Path(profiled["trace"]).stat().st_size > 0
    assert profiled["window"]["wall_ms"] > 0


def test_profile_needs_batched(capsys):
    argv = ["--engine", "synthetic", "--device", "cpu", "--profile", "x"]
    assert gpu_sessions.main(argv) == 2
    assert "--profile needs --batched" in capsys.readouterr().err


def test_busy_shares_count_overlapping_kernels_once():
    from types import SimpleNamespace

    from torch.profiler import DeviceType

    from omnifabric.tools import step_profile

    def event(name: str, start: float, end: float, device=DeviceType.CPU) -> SimpleNamespace:
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, time_range=span, device_type=device)

    events = [
        event("minicpmo.decode", 0, 1000),
        event("minicpmo.decode", 2000, 3000),
        event("minicpmo.tts", 3000, 4000),
        event("kernel", 100, 400, DeviceType.CUDA),
        event("kernel", 300, 600, DeviceType.CUDA),  # overlaps the first: 100-600 busy
        event("kernel", 2500, 3500, DeviceType.CUDA),  # half in decode, half in tts
    ]
    report = step_profile.shares(events, 4.0)
    decode, tts = report["phases"]["decode"], report["phases"]["tts"]
    assert decode["ranges"] == 2 and decode["wall_ms"] == 2.0
    assert decode["gpu_busy_ms"] == 1.0 and decode["busy_share"] == 0.5
    assert tts["gpu_busy_ms"] == 0.5
    assert report["window"]["wall_ms"] == 4.0 and report["window"]["gpu_busy_ms"] == 1.5
    assert report["gpu_measured"] is True


def test_host_counts_per_phase_count_each_op_once():
    from types import SimpleNamespace

    from torch.profiler import DeviceType

    from omnifabric.tools import step_profile

    def event(name: str, at: float, parent: object = None) -> SimpleNamespace:
        span = SimpleNamespace(start=at, end=at + 1)
        return SimpleNamespace(
            name=name, time_range=span, device_type=DeviceType.CPU, cpu_parent=parent
        )

    decode = SimpleNamespace(**vars(event("minicpmo.decode", 0)))
    decode.time_range = SimpleNamespace(start=0, end=100)
    tts = SimpleNamespace(**vars(event("minicpmo.tts", 0)))
    tts.time_range = SimpleNamespace(start=120, end=200)
    add = event("aten::add", 10, decode)
    contiguous = event("aten::contiguous", 20, decode)
    item = event("aten::item", 30, decode)
    events = [
        decode,
        tts,
        add,
        event("aten::empty", 11, add),  # inside a counted op
        event("aten::view", 12, decode),  # no kernel
        contiguous,
        event("aten::clone", 21, contiguous),  # the copy a view-like op made: counted
        item,
        event("aten::_local_scalar_dense", 31, item),
        event("cudaLaunchKernel", 40, add),
        event("cudaGraphLaunch", 150, tts),
        event("cudaStreamSynchronize", 160, tts),
        event("aten::mul", 110),  # between two phases of the steps: the window only
        event("aten::div", 300),  # after the steps (a session's close): not even the window
    ]
    report = step_profile.shares(events, 0.3)
    host = {name: f["host"] for name, f in report["phases"].items()}
    assert host["decode"] == {"ops": 3, "reads": 1, "launches": 1, "replays": 0, "syncs": 0}
    assert host["tts"] == {"ops": 0, "reads": 0, "launches": 0, "replays": 1, "syncs": 1}
    assert report["window"]["host"]["ops"] == 4
    report.update(trace="t.json", sessions=2, steps=2, cycle_ms=1.0)
    printed = step_profile.lines(report)
    assert any(
        line.strip().startswith("decode") and "a step: 2 ops, 0 reads" in line for line in printed
    ), printed


def test_in_step_mode_puts_the_host_between_decode_forwards_and_back():
    from types import SimpleNamespace

    from omnifabric.tools import batched

    engine = SimpleNamespace(decode_ahead=2, vocoder_batched=True)
    with batched.engine_mode(engine, None, batched.IN_STEP):
        assert engine.decode_ahead == 0 and engine.vocoder_batched
    assert engine.decode_ahead == 2
    with batched.engine_mode(engine, None, batched.BATCHED):
        assert engine.decode_ahead == 2


def test_the_summary_says_what_each_graph_set_did():
    from omnifabric.tools import batched

    graphs = {
        "decode": {"static": True, "graphs": True, "captured": 3, "replays": 40, "failure": None},
        "flow": {"static": True, "graphs": False, "captured": 0, "replays": 0, "failure": "E: x"},
        "hift": {"static": False, "graphs": False, "captured": 0, "replays": 0, "failure": None},
    }
    row = {"mode": batched.BATCHED, "sessions": 2, "real_time": True, "graphs": graphs}
    row["vocoder_cache_mib_per_session"] = None
    lines = batched.summary([row])
    assert (
        "N=2: graphs: decode 3 graphs, 40 replays; flow eager after a failed capture (E: x); "
        "hift ragged eager"
    ) in lines, lines
    assert not any("graphs" in line for line in batched.summary([{**row, "graphs": {}}]))


@pytest.mark.parametrize(
    "tf32, says",
    [
        (True, "N=2: vocoder caches 5.4 MiB per session; its flow in TF32"),
        (False, "N=2: vocoder caches 5.4 MiB per session; its flow in full float32"),
        (None, "N=2: vocoder caches 5.4 MiB per session"),  # an engine without the setting
    ],
)
def test_the_summary_says_how_the_vocoders_flow_ran(tf32, says):
    from omnifabric.tools import batched

    row = {"mode": batched.BATCHED, "sessions": 2, "real_time": True, "graphs": {}}
    row.update(vocoder_cache_mib_per_session=5.4, vocoder_tf32=tf32)
    assert says in batched.summary([row])


def test_the_summary_gives_the_voices_apart():
    """A voice's caches are held once for its sessions (vocoder.Voice): the summary gives
    them beside the sessions' own."""
    from omnifabric.tools import batched

    row = {"mode": batched.BATCHED, "sessions": 2, "real_time": True, "graphs": {}}
    row.update(vocoder_cache_mib_per_session=5.4, vocoder_voices_mib=2.1, vocoder_tf32=None)
    want = "N=2: vocoder caches 5.4 MiB per session, and 2.1 MiB of voices they share"
    assert want in batched.summary([row])
