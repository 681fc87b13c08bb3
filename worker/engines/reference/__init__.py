"""The CPU reference engine: silero-vad, Whisper tiny.en, SmolLM2-135M-Instruct, espeak-ng."""
