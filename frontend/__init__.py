"""radixserve's front-end language: structured generation programs over the HTTP API.

    import frontend as sgl
    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:8000"))

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    state = qa.run(question="...")
    state["answer"]

The API mirrors SGLang's frontend language (gen, select, fork, run_batch, roles).
"""
from frontend.backend import (
    ChoiceScores, Completion, RuntimeEndpoint, ServerError, Usage, get_default_backend,
    set_default_backend,
)
from frontend.chat_template import ChatMarkers, ChatTemplateError
from frontend.ir import (
    assistant, assistant_begin, assistant_end, gen, select, system, system_begin, system_end, user,
    user_begin, user_end,
)
from frontend.program import Program, function
from frontend.state import ForkGroup, ProgramState

__all__ = [
    "ChatMarkers", "ChatTemplateError", "ChoiceScores", "Completion", "ForkGroup", "Program",
    "ProgramState", "RuntimeEndpoint", "ServerError", "Usage", "assistant", "assistant_begin",
    "assistant_end", "function", "gen", "get_default_backend", "select", "set_default_backend",
    "system", "system_begin", "system_end", "user", "user_begin", "user_end",
]
