"""Random-weight `assets/token2wav` for MiniCPM-o 4.5's vocoder (the `stepaudio2.Token2wav` of
`minicpmo-utils` 1.0.7), so speech output runs without the real weights.

    python -m omnifabric.tools.vocoder_assets --out CHECKPOINT/assets/token2wav [--full]

What Token2wav 1.0.7 loads, and where each setting here comes from:
- `flow.yaml` + `flow.pt`: CausalMaskedDiffWithXvec = UpsampleConformerEncoderV2 (6 + 4 blocks,
  512 wide, 8 heads, rel_pos_espnet, 3 lookahead tokens, x2 upsampling) + CausalConditionalCFM
  (cfg rate 0.7) over a DiT (16 blocks, 512 hidden, 8 heads of 64, mlp ratio 4), 6561 speech
  tokens, 192-dim speaker embedding: the released flow.yaml's values as vLLM-Omni's Lychee
  token2wav stage checks them setting by setting (vllm_omni/model_executor/models/lychee_fd).
- `config.yaml` + `hift.pt`: CosyVoice3's CausalHiFTGenerator (24 kHz, upsampling 8x5x3 with an
  ISTFT of 16/4: 480 samples a mel frame; CausalConvRNNF0Predictor) as FunAudioLLM CosyVoice3's
  cosyvoice3.yaml defines it, and the mel settings Token2wav checks (n_fft 1920, hop 480,
  fmax 8000).
- `hift_original.pt`: flashcosyvoice's HiFTGenerator with its defaults (whole-utterance path).
- `campplus.onnx`, `speech_tokenizer_v2_25hz.onnx`: STAND-INS. The released files are exported
  graphs (CAM++ speaker embedding; the S3 speech tokenizer v2) that cannot be rebuilt here.
  The stand-ins keep their interfaces: 80-dim fbank [1, T, 80] -> a [1, 192] embedding, and a
  128-bin log mel [1, 128, T] at 100 Hz -> [1, T/4] token ids below 6561 (25 Hz). They are
  marked (metadata `omnifabric.stand_in`); worker/engines/minicpmo/vocoder.py runs the marked
  tokenizer itself and a real one through s3tokenizer.

--full keeps these sizes (about 110 M flow and 21 M HiFT parameters, float32); the default is
tiny for CPU tests (the same classes, narrower and shallower: ~1 M parameters).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: The marker the stand-in ONNX files carry (metadata key -> which part it stands in for).
STAND_IN_KEY = "omnifabric.stand_in"
#: Speech tokens of the S3 tokenizer v2 (3^8) and the tokenizer's frames per token.
SPEECH_TOKENS = 6561
TOKEN_STRIDE = 4

FLOW_FULL: dict[str, Any] = {
    "input_size": 512,
    "encoder": {
        "output_size": 512,
        "num_blocks": 6,
        "num_up_blocks": 4,
        "attention_heads": 8,
        "linear_units": 2048,
    },
    "dit": {"depth": 16, "hidden_size": 512, "num_heads": 8, "head_dim": 64, "mlp_ratio": 4.0},
}
FLOW_TINY: dict[str, Any] = {
    "input_size": 64,
    "encoder": {
        "output_size": 64,
        "num_blocks": 1,
        "num_up_blocks": 1,
        "attention_heads": 2,
        "linear_units": 128,
    },
    "dit": {"depth": 2, "hidden_size": 64, "num_heads": 2, "head_dim": 32, "mlp_ratio": 2.0},
}
HIFT_FULL = {"base_channels": 512, "cond_channels": 512}
HIFT_TINY = {"base_channels": 32, "cond_channels": 32}


def flow_yaml(spec: dict[str, Any]) -> str:
    """flow.yaml in the released layout (its hyperpyyaml tags, which Token2wav maps)."""
    enc, dit = spec["encoder"], spec["dit"]
    return f"""\
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {spec["input_size"]}
    output_size: 80
    spk_embed_dim: 192
    output_type: mel
    vocab_size: {SPEECH_TOKENS}
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {spec["input_size"]}
        output_size: {enc["output_size"]}
        input_layer: linear
        pre_lookahead_len: 3
        num_blocks: {enc["num_blocks"]}
        num_up_blocks: {enc["num_up_blocks"]}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: {enc["attention_heads"]}
        pos_enc_layer_type: rel_pos_espnet
        selfattention_layer_type: rel_selfattn
        key_bias: true
        linear_units: {enc["linear_units"]}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: {dit["mlp_ratio"]}
            depth: {dit["depth"]}
            num_heads: {dit["num_heads"]}
            head_dim: {dit["head_dim"]}
            hidden_size: {dit["hidden_size"]}
"""


def hift_yaml(spec: dict[str, int]) -> str:
    """config.yaml: the causal HiFT and the mel extractor Token2wav checks."""
    return f"""\
sample_rate: 24000
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {spec["base_channels"]}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {spec["cond_channels"]}
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""


def _onnx_stand_in(graph: Any, part: str, path: Path) -> None:
    import onnx

    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime 1.18-1.21 read IR <= 10
    entry = model.metadata_props.add()
    entry.key, entry.value = STAND_IN_KEY, part
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def speaker_stand_in(path: Path, rng: Any) -> None:
    """campplus.onnx stand-in: fbank [1, T, 80] -> mean over time -> x W [80, 192]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = (rng.standard_normal((80, 192)) / np.sqrt(80)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["feats"], ["pooled"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["pooled", "weight"], ["embedding"]),
        ],
        "speaker_stand_in",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 192])],
        [numpy_helper.from_array(weight, "weight")],
    )
    _onnx_stand_in(graph, "campplus", path)


def tokenizer_stand_in(path: Path, rng: Any) -> None:
    """speech_tokenizer_v2_25hz.onnx stand-in: log mel [1, 128, T] (100 Hz) -> every 4th frame
    -> x W [128, 6561] -> argmax: [1, T/4] ids."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = rng.standard_normal((128, SPEECH_TOKENS)).astype(np.float32)
    consts = {
        "starts": [0],
        "ends": [2**62],
        "axes": [2],
        "steps": [TOKEN_STRIDE],
    }
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["feats", "starts", "ends", "axes", "steps"], ["picked"]),
            helper.make_node("Transpose", ["picked"], ["frames"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["frames", "weight"], ["scores"]),
            helper.make_node("ArgMax", ["scores"], ["tokens"], axis=2, keepdims=0),
        ],
        "speech_tokenizer_stand_in",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "N"])],
        [numpy_helper.from_array(weight, "weight")]
        + [numpy_helper.from_array(np.array(v, dtype=np.int64), k) for k, v in consts.items()],
    )
    _onnx_stand_in(graph, "speech_tokenizer", path)


#: Random weights that make audio depend on its input (see liven): the DiT's adaLN gain, the
#: HiFT's per-channel weight norm, and the F0 the predictor's bias gives (Hz).
DIT_GATE, HIFT_GAIN, F0_HZ = 20.0, 0.9, 150.0


def liven(flow: Any, hift: Any) -> None:
    """Random weights whose audio depends on the tokens, voice and history, so comparisons of
    it can fail. At N(0, 0.02) the HiFT shrinks its input layer by layer (its samples were
    the same to the int16 step whatever the mel), the DiT's adaLN gates leave attention a
    small share of each block, and the predicted F0 (~0.1 Hz) stays under the 10 Hz voiced
    threshold, so the sine source never sounds. Here: adaLN x DIT_GATE, every HiFT
    convolution and linear layer at HIFT_GAIN per output channel, and F0 near F0_HZ."""
    import torch

    with torch.no_grad():
        for block in flow.decoder.estimator.blocks:
            block.adaLN_modulation[-1].weight.mul_(DIT_GATE)
        for layer in hift.modules():
            if not isinstance(layer, torch.nn.Conv1d | torch.nn.Linear):
                continue
            module: Any = layer
            if hasattr(module, "parametrizations"):
                module.parametrizations.weight.original0.fill_(HIFT_GAIN)
            else:
                weight = module.weight
                norm = weight.flatten(1).norm(dim=1).view(-1, *[1] * (weight.dim() - 1))
                weight.mul_(HIFT_GAIN / norm)
        hift.f0_predictor.classifier.bias.fill_(F0_HZ)


def build(out: Path, full: bool = False, seed: int = 0) -> dict[str, Any]:
    """Write the seven files Token2wav needs into `out`; returns a summary (parameters)."""
    import numpy as np
    import torch
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator
    from stepaudio2.token2wav import _load_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flow.yaml").write_text(flow_yaml(FLOW_FULL if full else FLOW_TINY))
    (out / "config.yaml").write_text(hift_yaml(HIFT_FULL if full else HIFT_TINY))
    torch.manual_seed(seed)
    flow = _load_config(out / "flow.yaml")["flow"]
    hift = _load_config(out / "config.yaml", {"hifigan": None})["hift"]
    original = HiFTGenerator()
    for module in (flow, hift, original):
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
    liven(flow, hift)
    torch.save(flow.state_dict(), out / "flow.pt")
    torch.save(hift.state_dict(), out / "hift.pt")
    torch.save(original.state_dict(), out / "hift_original.pt")
    rng = np.random.default_rng(seed)
    speaker_stand_in(out / "campplus.onnx", rng)
    tokenizer_stand_in(out / "speech_tokenizer_v2_25hz.onnx", rng)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"out": str(out), "flow": count(flow), "hift": count(hift)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.vocoder_assets", description=__doc__
    )
    parser.add_argument("--out", required=True, type=Path, help="folder to write (token2wav)")
    parser.add_argument("--full", action="store_true", help="the released sizes, not tiny")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    try:
        summary = build(args.out, args.full, args.seed)
    except ImportError as exc:
        print(
            f"vocoder_assets: needs the vocoder package ({exc}): bash tools/dev minicpmo --vocoder",
            file=sys.stderr,
        )
        return 2
    print(
        f"{'full-size' if args.full else 'tiny'} token2wav assets: {summary['out']} "
        f"(flow {summary['flow'] / 1e6:.1f} M, HiFT {summary['hift'] / 1e6:.2f} M parameters)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
