"""`server_app()`, exported by `asgi_cancel.llama_cpp`: llama-cpp-python's OpenAI server behind
the middleware, with the cancel processor (`llama_cpp.logits_processor()`) added to every
completion, streaming or not, through the one function its routes call with each request's
arguments.

Nothing here imports llama_cpp until `server_app()` is called.
"""

from __future__ import annotations

import functools
from typing import Any

from ._middleware import CancelOnDisconnectMiddleware

__all__ = ["server_app"]


def server_app(**options: Any) -> CancelOnDisconnectMiddleware:
    """llama-cpp-python's OpenAI server, stopping each completion when its request stops.

    `llama_cpp.server.app.create_app()`, configured as llama-cpp-python documents it
    (`MODEL=...`, `CONFIG_FILE=...`), behind `CancelOnDisconnectMiddleware(**options)`, with
    `logits_processor()` added to every completion and chat completion, streaming or not:

        MODEL=model.gguf uvicorn asgi_cancel.llama_cpp:server_app --factory

    The processor reaches the server's calls through `prepare_request_resources`, the function
    its routes call with each request's arguments, in the request's context; it is wrapped
    once per process. Tested with llama-cpp-python 0.3.36.

    Args:
        **options: for `CancelOnDisconnectMiddleware`.

    Raises:
        ImportError: llama-cpp-python's server extra is not installed.
        RuntimeError: this llama-cpp-python has no `prepare_request_resources` to wrap.
    """
    from .llama_cpp import _missing, logits_processor  # (here: llama_cpp imports this module)

    try:
        from llama_cpp.server import app as server
    except ImportError as error:
        raise _missing(error, "'asgi-cancel[llama-cpp]' 'llama-cpp-python[server]'") from error
    prepare = getattr(server, "prepare_request_resources", None)
    if prepare is None:
        raise RuntimeError(
            "asgi_cancel.llama_cpp.server_app: llama_cpp.server.app has no "
            "prepare_request_resources (tested with llama-cpp-python 0.3.36): add "
            "logits_processor() to its calls another way"
        )
    if not getattr(prepare, "_asgi_cancel", False):

        @functools.wraps(prepare)
        def prepare_with_cancel(
            body: Any, llama_proxy: Any, body_model: Any, kwargs: dict[str, Any]
        ) -> Any:
            llm = prepare(body, llama_proxy, body_model, kwargs)
            # Last, after the server's own (min_tokens): a processor, as the chat route's
            # create_chat_completion takes no stopping_criteria.
            kwargs["logits_processor"] = logits_processor(llm, *kwargs.get("logits_processor", ()))
            return llm

        prepare_with_cancel._asgi_cancel = True  # type: ignore[attr-defined]
        server.prepare_request_resources = prepare_with_cancel
    return CancelOnDisconnectMiddleware(server.create_app(), **options)
