"""Build a tiny random-weight Llama that real vLLM can serve on a CPU, with no downloads.

The tests and the demo need a real engine, not a good model: this one has 213k parameters
(hidden 64, 2 layers, 2 heads of 32: vLLM's CPU attention accepts head sizes 32, 64, 80, ...),
a byte-level BPE tokenizer trained here on a built-in corpus, `<s>`/`</s>`/`<pad>` and a chat
template, saved as safetensors. Its output is random text; its speed is what matters: about
100 tokens/s per sequence through `AsyncLLM` on 2 cores.

Run `python -m example_app.tiny_model OUTDIR` (needs `transformers`, `tokenizers` and `torch`,
all installed with vLLM). Building takes about 10 s; an existing model is reused.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_model"]

logger = logging.getLogger("example_app.tiny_model")

# Files whose presence means the model is complete (written last: config.json).
_MARKERS = ("tokenizer.json", "model.safetensors", "config.json")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)

_CORPUS = """\
The client went away, so the server stopped generating tokens for it.
A request that nobody reads is work that nobody needs: cancel it, free the batch slot.
Every HTTP server sends a disconnect message when the connection closes.
The engine schedules requests, runs a forward pass, samples one token per sequence, repeat.
Hello world! How are you today? I am fine, thank you. What time is it?
def generate(prompt, params, request_id): yield tokens until the stream is finished
{"role": "user", "content": "Write a story about a tiny llama that runs on a CPU."}
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>/\\|-_=+*&^%$#@~`
"""


def build_tiny_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Build the tiny model into `path` (a directory), or reuse the one already there.

    Idempotent and safe to call from several processes: the model is built in a temporary
    directory next to `path` and moved into place in one rename.

    Args:
        path: the model directory to create; vLLM takes it as `model=`.
        seed: seeds the random weights, so two builds give the same model.

    Returns:
        The model directory, as a `Path`.
    """
    target = Path(path)
    if all((target / name).is_file() for name in _MARKERS):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        _build(staging, seed)
        try:
            staging.rename(target)
        except OSError:
            if not all((target / name).is_file() for name in _MARKERS):
                # A half-built model left by an interrupted run: replace it.
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
            # else: another process finished first; keep its model.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("tiny model built in %s", target)
    return target


def _build(outdir: Path, seed: int) -> None:
    # Imported here, not at module level: they are vLLM's dependencies, not asgi-cancel's.
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    torch: Any = importlib.import_module("torch")

    special = ["<s>", "</s>", "<pad>"]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=450,
        special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines() * 20, trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(outdir)

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(outdir, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m example_app.tiny_model OUTDIR\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.stdout.write(f"{build_tiny_model(args[0])}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
