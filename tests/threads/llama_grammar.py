"""One grammar-constrained llama-cpp-python generation, cancelled mid-structure, in its own
process: llama.cpp aborts the process when its grammar is left no token to sample (SIGABRT),
so tests/threads/test_llama_cpp.py runs this and reads its exit status and its last line.

    python -m tests.threads.llama_grammar MODEL completion|chat CANCEL_AT

`create_completion` or `create_chat_completion`, streaming, with `logits_processor()` and a
grammar: `{`, letters and spaces, `}` (the tiny model writes no `}` for over 40 tokens, and
end-of-sequence is forbidden until it does). The request's token is fired after CANCEL_AT
chunks (0: never). Prints a JSON line: the chunks read, the last chunk's finish_reason, and
the processor's count of tokens.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import llama_cpp

from asgi_cancel import CancelToken
from asgi_cancel.llama_cpp import logits_processor

MAX_TOKENS = 60
GRAMMAR = 'root ::= "{" [a-z ]* "}"'


def main(model: str, kind: str, cancel_at: int) -> None:
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=1, verbose=False, seed=1)
    token = CancelToken()
    processors = logits_processor(llm, token=token)
    common: dict[str, Any] = {
        "grammar": llama_cpp.LlamaGrammar.from_string(GRAMMAR, verbose=False),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "logits_processor": processors,
    }
    if kind == "chat":
        messages: Any = [{"role": "user", "content": "hello there"}]
        chunks = llm.create_chat_completion(messages=messages, **common)
    else:
        chunks = llm.create_completion("hello", **common)
    read, finish = 0, None
    for chunk in chunks:
        read += 1
        if read == cancel_at:
            token.fire("client disconnected")
        finish = chunk["choices"][0]["finish_reason"] or finish
    result = {"chunks": read, "finish": finish, "generated": processors[-1].generated}
    print(json.dumps(result), flush=True)  # noqa: T201  (read by the test)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
