"""Build a tiny random-weight Qwen3-ASR that vLLM serves at `/v1/realtime`, with no downloads.

vLLM 0.32 registers its realtime route only for a model class that implements
`SupportsRealtime`: `Qwen3ASRRealtimeGeneration` and `VoxtralRealtimeGeneration`; the tiny Llama
of the other tests gets no such route. This builds the first from transformers' own Qwen3-ASR
classes with `architectures` set to the realtime class: 241k parameters (an audio encoder of
one layer, d_model 64; a Qwen3 text model of 2 layers, hidden 64, heads of 32, vocabulary
1024), a byte-level BPE tokenizer trained here with the chat and audio special tokens, and
Qwen3-ASR's feature extractor (128 mel bins, 16 kHz). Its output is random text; on 2 cores it
generates about 250 tokens/s, 64 per 5 s segment of audio.

Run `python -m tests.vllm.tiny_asr OUTDIR` (needs `transformers`, `tokenizers` and `torch`, all
installed with vLLM; .ci/vllm.sh does it). Building takes a few seconds; an existing model is
reused. vLLM needs `tests/vllm/no_torchvision` on `PYTHONPATH` to load it (see there).
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Written last: its presence means the model is complete.
MARKER = "config.json"

_CORPUS = """\
The client went away, so the server stopped generating tokens for it.
language English<asr_text>hello world, this is a tiny speech model that says random things.
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>/\\|-_=+*&^%$#@~`
"""
_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<asr_text>",
]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_asr(path: str | Path, *, seed: int = 0) -> Path:
    """Build the model into `path`, or reuse the one there; built aside, moved in one rename."""
    target = Path(path)
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        _build(staging, seed)
        if not (target / MARKER).is_file():  # else another process finished first
            shutil.rmtree(target, ignore_errors=True)  # a half-built model
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(outdir: Path, seed: int) -> None:
    # vLLM's dependencies, not asgi-cancel's: imported here.
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    torch: Any = importlib.import_module("torch")
    qwen3_asr: Any = importlib.import_module("transformers.models.qwen3_asr")

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=_SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines() * 20, trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    processor = qwen3_asr.Qwen3ASRProcessor(
        feature_extractor=qwen3_asr.Qwen3ASRFeatureExtractor(), tokenizer=tokenizer
    )
    processor.save_pretrained(outdir)

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _SPECIAL}
    torch.manual_seed(seed)
    config = qwen3_asr.Qwen3ASRConfig(
        audio_config={
            "model_type": "qwen3_asr_encoder",
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "output_dim": 64,
            "n_window": 50,
            "n_window_infer": 800,
            "downsample_hidden_size": 32,
            "max_position_embeddings": 13,
        },
        text_config={
            "model_type": "qwen3",
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,  # vLLM's CPU attention takes 32, 64, 80, ...
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [4, 6, 6],
                "interleaved": True,
            },
        },
        audio_token_id=ids["<|audio_pad|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]],
        tie_word_embeddings=True,
    )
    model = qwen3_asr.Qwen3ASRForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(outdir, safe_serialization=True)
    # transformers saves its own class name; vLLM picks its model class by this name.
    config_path = outdir / MARKER
    saved = json.loads(config_path.read_text())
    saved["architectures"] = ["Qwen3ASRRealtimeGeneration"]
    config_path.write_text(json.dumps(saved, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.vllm.tiny_asr OUTDIR")
    sys.stdout.write(f"{build_tiny_asr(sys.argv[1])}\n")
