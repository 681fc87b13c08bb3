"""Build a tiny random-weight MiniCPM-o 4.5 checkpoint on CPU, for checks of the `minicpmo`
engine without the 9B weights (nothing of it is committed: you fetch the public code).

    python -m omnifabric.tools.minicpmo_tiny --code-dir CHECKOUT/MiniCPMO45 \\
        --sdk minicpm_o5_sdk-0.0.6-py3-none-any.whl --out /tmp/minicpmo-tiny

--code-dir: a folder of the public model code (`modeling_minicpmo.py` and its siblings), from
  OpenBMB/minicpm-o-4_5-pytorch-simple-demo or OpenBMB/MiniCPM-o-Demo (folder MiniCPMO45/),
  or a copy of the HF checkpoint's own code. Checked against:
    OpenBMB/minicpm-o-4_5-pytorch-simple-demo c7e1660 (layouts: duplex class, unified class)
    OpenBMB/MiniCPM-o-Demo 28b60cf (the same two layouts)
    chmod777john/MiniCPM-o-Demo d5e99a79 MiniCPMO45/modeling_minicpmo.py (MiniCPMO.as_duplex)
--sdk: the PyPI wheel `minicpm-o5-sdk==0.0.6` (`pip download --no-deps minicpm-o5-sdk==0.0.6`),
  its unpacked folder, or nothing when the package is installed: it carries the real
  `config.json` and `tokenizer.json` (qwen2_o45_fc), which the demo folders lack.

The real config is kept (auto_map `modeling_minicpmo.MiniCPMO`, token ids, vocabulary) and
only the widths and depths are shrunk (SHRINK below): ~52 M parameters, float32.

The vocoder's folder `assets/token2wav` is written too (tools/vocoder_assets.py: random weights
of the vocoder's public configuration, tiny or, with --full, the released sizes; two ONNX parts
are stand-ins) when the vocoder package (minicpmo-utils) is installed; --no-vocoder leaves it
out, and the engine then runs text only.

--full keeps the real widths and depths (random weights, bfloat16, ~18 GB on disk): a stand-in
for the real weights where no hub is reachable, for timing and memory figures on a GPU (its
replies are noise). Build it with --device cuda: on CPU it needs ~40 GB of memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

#: Where the real config lives inside the SDK package.
SDK_FOLDER = "minicpm_o5_sdk/tokenizers/base_tokenizers/qwen2_o45_fc"
#: Files of the code folder a checkpoint needs (besides *.py).
CODE_FILES = (
    "added_tokens.json",
    "generation_config.json",
    "merges.txt",
    "preprocessor_config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "vocab.json",
)
#: Widths and depths of the tiny model (each part keeps the real code's constraints:
#: resampler heads = hidden // 128, audio projection input = encoder_ffn_dim // 4).
SHRINK: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "audio_config": {
        "d_model": 64,
        "encoder_ffn_dim": 256,
        "encoder_layers": 1,
        "encoder_attention_heads": 4,
        "decoder_ffn_dim": 256,
        "decoder_layers": 1,
        "decoder_attention_heads": 4,
        "num_hidden_layers": 1,
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    },
    "tts_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "llm_dim": 128,
        "llm_hidden_size": 128,
        "llm_intermediate_size": 128,
    },
}


def shrink(config: dict[str, Any], spec: dict[str, Any] = SHRINK) -> dict[str, Any]:
    """A copy of `config` with the SHRINK values put in (nested dicts merged)."""
    out = json.loads(json.dumps(config))
    for key, value in spec.items():
        if isinstance(value, dict):
            out[key] = shrink(out.get(key) or {}, value)
        else:
            out[key] = value
    return out


def read_sdk(sdk: str | None, name: str) -> bytes:
    """One file of the SDK's qwen2_o45_fc folder: from a wheel, a folder, or the installed
    package. Raises FileNotFoundError saying where it looked."""
    if sdk:
        path = Path(sdk)
        if path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as wheel:
                return wheel.read(f"{SDK_FOLDER}/{name}")
        for candidate in (path / SDK_FOLDER / name, path / name):
            if candidate.is_file():
                return candidate.read_bytes()
        raise FileNotFoundError(f"{name} not found in {path}")
    spec = importlib.util.find_spec("minicpm_o5_sdk")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the real config.json comes from the PyPI wheel minicpm-o5-sdk==0.0.6: "
            "pip download --no-deps minicpm-o5-sdk==0.0.6, then pass it with --sdk"
        )
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return (root / SDK_FOLDER / name).read_bytes()


def copy_code(code_dir: Path, out: Path) -> list[str]:
    """Copy the model's python files and tokenizer/processor files; returns their names."""
    if not (code_dir / "modeling_minicpmo.py").is_file():
        raise FileNotFoundError(f"{code_dir} has no modeling_minicpmo.py")
    copied = []
    for path in sorted(code_dir.iterdir()):
        if path.suffix == ".py" or path.name in CODE_FILES:
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    return copied


def build(
    code_dir: Path,
    out: Path,
    sdk: str | None = None,
    seed: int = 0,
    full: bool = False,
    device: str = "cpu",
    vocoder: bool | None = None,
) -> dict[str, Any]:
    """Write the tiny checkpoint (full: the real-size one) to `out`; returns a summary
    (parameters, files, vocoder). vocoder: write assets/token2wav (None: when the vocoder
    package is installed)."""
    code_dir, out = Path(code_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copied = copy_code(code_dir, out)
    real = json.loads(read_sdk(sdk, "config.json"))
    config = dict(real) if full else shrink(real)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if not (out / "tokenizer.json").exists():
        (out / "tokenizer.json").write_bytes(read_sdk(sdk, "tokenizer.json"))

    import torch

    from omnifabric.worker.engines.minicpmo.code import import_module

    torch.manual_seed(seed)
    # The class the config's auto_map names, imported as the engine imports it.
    module_name, class_name = real["auto_map"]["AutoModel"].rsplit(".", 1)
    config_module, config_class = real["auto_map"]["AutoConfig"].rsplit(".", 1)
    cfg = getattr(import_module(out, config_module), config_class).from_pretrained(str(out))
    cls = getattr(import_module(out, module_name), class_name)
    dtype = torch.bfloat16 if full else torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype, on its device: no float32 copy
    try:
        with torch.device(device):
            model = cls(cfg).to(dtype)
    finally:
        torch.set_default_dtype(before)
    model.save_pretrained(str(out), safe_serialization=True)
    # save_pretrained rewrites config.json from the object: keep the real auto_map.
    saved = json.loads((out / "config.json").read_text())
    saved["auto_map"] = real["auto_map"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    if vocoder is None:
        vocoder = importlib.util.find_spec("stepaudio2") is not None
    voc = None
    if vocoder:
        from omnifabric.tools import vocoder_assets

        voc = vocoder_assets.build(out / "assets" / "token2wav", full=full, seed=seed)
    return {
        "out": str(out),
        "vocoder": voc,
        "parameters": sum(p.numel() for p in model.parameters()),
        "auto_map": real["auto_map"]["AutoModel"],
        "code_files": copied,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.minicpmo_tiny", description=__doc__
    )
    parser.add_argument("--code-dir", required=True, type=Path, help="folder of the model code")
    parser.add_argument("--sdk", help="minicpm-o5-sdk 0.0.6 wheel or folder (default: installed)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    parser.add_argument(
        "--full", action="store_true", help="the real widths and depths (bfloat16), not tiny"
    )
    parser.add_argument("--device", default="cpu", help="where the weights are made (cpu, cuda)")
    parser.add_argument(
        "--no-vocoder", action="store_true", help="no assets/token2wav (the model runs text only)"
    )
    args = parser.parse_args(argv)
    try:
        summary = build(
            args.code_dir,
            args.out,
            args.sdk,
            args.seed,
            args.full,
            args.device,
            vocoder=False if args.no_vocoder else None,
        )
    except (FileNotFoundError, KeyError) as exc:
        print(f"minicpmo_tiny: {exc}", file=sys.stderr)
        return 2
    print(
        f"{'full-size' if args.full else 'tiny'} MiniCPM-o checkpoint: {summary['out']} "
        f"({summary['parameters'] / 1e6:.1f} M "
        f"parameters, AutoModel -> {summary['auto_map']})"
    )
    voc = summary["vocoder"]
    print(
        f"vocoder: {voc['out']} (flow {voc['flow'] / 1e6:.1f} M, HiFT {voc['hift'] / 1e6:.2f} M)"
        if voc
        else "vocoder: none (minicpmo-utils not installed, or --no-vocoder): text only"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
