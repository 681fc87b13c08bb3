"""The vocoder alone: one batched call (vocoder_batch.BatchedVocoder.run) for N sessions'
next chunk against the package's `stream` per session, with each session's cache memory.
The batched call runs two ways in the same run: ragged eager forwards, and its flow matching
in static shapes (vocoder_flow; replayed as CUDA graphs on CUDA, eager on a CPU).

    python -m omnifabric.tools.vocoder_bench --device cuda --counts 1,8,16,32,64 \\
        [--assets DIR | --full] [--voice A.wav --voice B.wav] [--timesteps 10] \\
        [--tf32 off|on|both] [--json out.json]

Without --assets it builds random-weight assets (tools/vocoder_assets.py; --full: the
released sizes) in a temporary folder. Sessions take the voices in turn. Each figure is the
median of 4 timed calls after 2 untimed ones (the conformer compiles its variants then).
--timesteps: the flow's Euler steps (the package's default 10, as the HF layout's vocoder;
the unified layout builds it with 5). --tf32 both: every figure with the flow's float32
matrix products in full float32, then in TF32 (vocoder.precision), in one run.
--deviation N: how far TF32 moves the audio: N sessions' PCM over 4 chunks against full
float32 (on a CPU emulated: every product of the flow, where precision() puts TF32, its
operands rounded to TF32's 10 mantissa bits; and, to compare, as the package's float16
option makes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: A chunk: 25 fresh tokens and 3 of lookahead; a speech token is below this.
CHUNK, VOCAB = 28, 6561
WARM, TIMED = 2, 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.vocoder_bench", description=__doc__
    )
    parser.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (cuda)")
    parser.add_argument("--counts", default="1,8,16,32,64", help="sessions per call")
    parser.add_argument("--assets", type=Path, default=None, help="a token2wav folder")
    parser.add_argument("--full", action="store_true", help="built assets: the released sizes")
    parser.add_argument("--voice", action="append", default=[], help="voice WAV (repeatable)")
    parser.add_argument("--timesteps", type=int, default=10, help="flow Euler steps (10)")
    parser.add_argument(
        "--tf32",
        choices=("off", "on", "both"),
        default="off",
        help="the vocoder flow's float32 matrix products in TF32 (both: off, then on)",
    )
    parser.add_argument(
        "--deviation",
        type=int,
        default=0,
        metavar="N",
        help="also N sessions' PCM over 4 chunks in TF32 against full float32 (on a CPU, "
        "TF32 emulated)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser


def _tf32(x: Any) -> Any:
    """A float32 tensor rounded to TF32 (10 explicit mantissa bits, to nearest even), as a
    tensor core reads its operands; anything else as it is."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32).view_as(x)


def _float16(x: Any) -> Any:
    """A float32 tensor rounded to float16 and back; anything else as it is."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    return x.half().float()


#: What `emulated` rounds a product's operands (and, for float16, its result) to.
EMULATIONS = ("tf32", "float16")


def emulated(kind: str = "tf32") -> Any:
    """A torch function mode in which every matrix product (linear, matmul, attention) runs
    as `kind` runs it on a GPU, on a CPU: tf32, its float32 operands rounded to TF32 and
    accumulated in float32 (a tensor core in TF32); float16, its operands and its result
    rounded to float16 (what float16 autocast, the package's `float16` option, makes of a
    product)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    if kind not in EMULATIONS:
        raise ValueError(f"no emulation of {kind!r}: {', '.join(EMULATIONS)}")
    products = {
        F.linear,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.bmm,
        torch.baddbmm,
        torch.addmm,
        torch.einsum,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
    }
    rounded = _tf32 if kind == "tf32" else _float16

    class Emulated(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func not in products:
                return func(*args, **(kwargs or {}))
            out = func(*(rounded(a) for a in args), **(kwargs or {}))
            return _float16(out) if kind == "float16" else out

    return Emulated()


def deviation(
    t2w: Any, voice: str, n: int, kind: str = "tf32", chunks: int = 4
) -> list[dict[str, float]]:
    """n sessions of `voice` through `chunks` batched calls (static shapes, the last one a
    turn's last), once in full float32 and once with the flow's products in `kind`: tf32
    (the vocoder's own on CUDA, emulated elsewhere) or float16 (emulated: a CPU only). Per
    session its samples, the signal's RMS and the difference's RMS, 99th percentile and
    maximum (int16 steps) and the signal-to-difference ratio in dB."""
    import numpy as np

    from omnifabric.worker.engines.minicpmo import vocoder_batch

    rng = np.random.default_rng(1)
    plan = [[rng.integers(0, VOCAB, CHUNK).tolist() for _ in range(n)] for _ in range(chunks)]
    cuda = t2w.device.type == "cuda"
    if cuda and kind != "tf32":
        raise ValueError(f"{kind} products are emulated on a CPU only")

    def speak(other: bool) -> list[Any]:
        t2w.tf32 = other and cuda
        t2w.set_stream_cache(voice)
        batched = vocoder_batch.BatchedVocoder(t2w, static=True, graphs=cuda)
        jobs = []
        for _ in range(n):
            flow = {k: v.clone() for k, v in t2w.stream_cache.items()}
            hift = {k: v.clone() for k, v in t2w.hift_cache_dict.items()}
            jobs.append(vocoder_batch.VocoderJob([], False, flow, hift, voice, t2w.cache[voice]))
        if other and not cuda:  # the flow's products emulated, where precision() puts TF32
            flow_call = batched._flow

            def in_kind(jobs: list[Any]) -> Any:
                with emulated(kind):
                    return flow_call(jobs)

            batched._flow = in_kind  # type: ignore[method-assign]
        pcm = [b""] * n
        for k, tokens in enumerate(plan):
            for job, ids in zip(jobs, tokens, strict=True):
                job.tokens, job.last_chunk = ids, k == chunks - 1
            out = batched.run(jobs)
            pcm = [a + b for a, b in zip(pcm, out, strict=True)]
        return [np.frombuffer(p, "<i2").astype(np.float64) for p in pcm]

    before = getattr(t2w, "tf32", False)
    try:
        full, other = speak(False), speak(True)
    finally:
        t2w.tf32 = before
    out = []
    for a, b in zip(full, other, strict=True):
        diff = np.abs(a - b)
        rms, drms = float(np.sqrt((a**2).mean())), float(np.sqrt((diff**2).mean()))
        out.append(
            {
                "samples": len(a),
                "signal_rms": rms,
                "diff_rms": drms,
                "diff_p99": float(np.percentile(diff, 99)),
                "diff_max": float(diff.max()),
                "snr_db": 20 * float(np.log10(rms / drms)) if drms else float("inf"),
            }
        )
    return out


def _median_ms(call: Any, sync: Any) -> float:
    for _ in range(WARM):
        call()
    sync()
    times = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def measure(t2w: Any, voices: list[str], counts: list[int], sync: Any) -> dict[str, Any]:
    """Per N: the batched call's ms, the serial estimate, cache MiB per session, peak GiB."""
    import numpy as np
    import torch

    from omnifabric.worker.engines.minicpmo import vocoder, vocoder_batch

    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(0, VOCAB, CHUNK).tolist()  # noqa: E731
    t2w.set_stream_cache(voices[0])
    serial = _median_ms(lambda: t2w.stream(tokens()), sync)
    ragged = vocoder_batch.BatchedVocoder(t2w)
    static = vocoder_batch.BatchedVocoder(t2w, static=True, graphs=True)
    out: dict[str, Any] = {"stream_ms": serial, "runs": []}
    for n in counts:
        jobs = []
        for i in range(n):
            voice = voices[i % len(voices)]
            t2w.set_stream_cache(voice)
            flow = {k: v.clone() for k, v in t2w.stream_cache.items()}
            hift = {k: v.clone() for k, v in t2w.hift_cache_dict.items()}
            jobs.append(vocoder_batch.VocoderJob([], False, flow, hift, voice, t2w.cache[voice]))

        def call(batched: Any, jobs: list[Any] = jobs) -> None:
            for job in jobs:
                job.tokens = tokens()
            batched.run(jobs)

        cuda = t2w.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = _median_ms(lambda: call(ragged), sync)
        static_ms = _median_ms(lambda: call(static), sync)
        mib = statistics.mean(vocoder.cache_bytes(j.stream_cache, j.hift_cache) for j in jobs)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        row: dict[str, Any] = {"sessions": n, "batched_ms": ms, "static_ms": static_ms}
        row.update(serial_ms=n * serial, cache_mib_per_session=mib / 2**20, peak_gib=peak)
        row.update(graphs=static.flow.captured, graph_failure=static.flow.failure)
        out["runs"].append(row)
        print(
            f"N={n:3d}: one batched call {ms:7.0f} ms, static {static_ms:7.0f} ms "
            f"({static.flow.captured} graphs), N x stream {n * serial:8.0f} ms "
            f"({n * serial / ms:5.1f}x), caches {mib / 2**20:6.1f} MiB a session"
            + (f", peak {peak:.1f} GiB" if peak is not None else ""),
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from omnifabric.common.paths import cache_root
    from omnifabric.tools import vocoder_assets
    from omnifabric.worker.engines.minicpmo import vocoder
    from omnifabric.worker.engines.minicpmo.voice import project_clip

    voices = args.voice or [str(project_clip(cache_root()))]
    counts = [int(c) for c in args.counts.split(",") if c.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.assets
        if folder is None:
            folder = Path(tmp) / "token2wav"
            vocoder_assets.build(folder, full=args.full)
        t2w = vocoder.make(folder, device=args.device, n_timesteps=args.timesteps)
        sync = torch.cuda.synchronize if t2w.device.type == "cuda" else (lambda: None)
        settings = {"off": [False], "on": [True], "both": [False, True]}[args.tf32]
        out: dict[str, Any] = {"timesteps": args.timesteps, "settings": []}
        for tf32 in settings:
            t2w.tf32 = tf32
            name = "TF32" if tf32 else "full float32"
            print(f"stream per session: measuring on {args.device}, {name}", flush=True)
            figures = measure(t2w, voices, counts, sync)
            figures["tf32"] = tf32
            out["settings"].append(figures)
            print(f"stream per session ({name}): {figures['stream_ms']:.0f} ms a chunk (1 s)")
        if args.deviation:
            # on a CPU, the package's float16 option's products too (emulated), to compare
            kinds = ["tf32"] if t2w.device.type == "cuda" else list(EMULATIONS)
            out["deviation"] = {}
            for kind in kinds:
                how = f"{kind} in the flow" + ("" if t2w.device.type == "cuda" else " (emulated)")
                rows = out["deviation"][kind] = deviation(t2w, voices[0], args.deviation, kind)
                for i, d in enumerate(rows):
                    print(
                        f"{how} against full float32, session {i}: {d['samples']} samples, "
                        f"signal rms {d['signal_rms']:.0f}, difference rms {d['diff_rms']:.1f} "
                        f"p99 {d['diff_p99']:.0f} max {d['diff_max']:.0f} (int16 steps), "
                        f"{d['snr_db']:.1f} dB",
                        flush=True,
                    )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
