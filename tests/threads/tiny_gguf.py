"""Write a tiny llama-architecture GGUF model with random weights and an embedded vocabulary.

For the llama.cpp tests and benchmark: nothing is downloaded. The vocabulary is a
SentencePiece-style one (`tokenizer.ggml.model = "llama"`: byte fallback, `▁`-prefixed
pieces), so llama.cpp tokenizes any prompt; a chat template is embedded for
`create_chat_completion`. The output rows of the control, unknown and byte tokens are zero, so
their logits are exactly 0 while the largest of the others is positive: greedy or top-k
sampling never picks end-of-sequence, and every generation runs to `max_tokens` unless it is
stopped. The sizes make one token cost about a millisecond on one core of a small CPU.

    python -m tests.threads.tiny_gguf OUT.gguf [--seed N]
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path
from typing import Any

EMBEDDING = 256
LAYERS = 4
HEADS = 4
FEED_FORWARD = 768
CONTEXT = 4096
WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (gguf.TokenType values) of the tiny vocabulary."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁", *string.ascii_letters, *string.digits, *string.punctuation]
    pieces += ["▁" + char for char in string.ascii_letters + string.digits]
    pieces += ["▁" + word for word in WORDS]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SentencePiece merges by score: longer pieces first, so words come out whole.
    scores = [0.0] * (3 + 256) + [float(len(piece)) for piece in pieces]
    return tokens, scores, [int(kind) for kind in types]


def write(path: Path, *, seed: int = 0) -> Path:
    """Write the model to `path` (deterministic for a given seed) and return it."""
    import gguf
    import numpy as np

    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> Any:
        # (out, in) in numpy: GGUF stores the reversed shape, as llama.cpp expects.
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype(np.float32)

    def ones(size: int) -> Any:
        return np.ones(size, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("asgi-cancel tiny llama (random weights)")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", matrix(len(tokens), EMBEDDING))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones(EMBEDDING))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", matrix(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones(EMBEDDING))
        writer.add_tensor(f"{block}.ffn_gate.weight", matrix(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_up.weight", matrix(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_down.weight", matrix(EMBEDDING, FEED_FORWARD))
    writer.add_tensor("output_norm.weight", ones(EMBEDDING))
    output = matrix(len(tokens), EMBEDDING)
    never_sampled = [i for i, kind in enumerate(types) if kind != gguf.TokenType.NORMAL]
    output[never_sampled, :] = 0.0
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out, seed=args.seed)


if __name__ == "__main__":
    main()
