"""Chat conversations to prompt strings, for `LLM.chat` (vLLM's meaning).

A conversation is a list of {"role": str, "content": str} dicts; `chat` takes one
conversation or a list of them. Each is rendered with the checkpoint tokenizer's chat
template (with the assistant's turn opened) and then generated like any text prompt.
"""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` (None when the checkpoint has none) carries a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def as_conversations(messages: object) -> list[list[dict]]:
    """One conversation or a list of them, as a list of conversations; malformed input
    raises TypeError/ValueError naming the conversation, message and key at fault."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: pass at least one conversation")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"conversation {i} is empty")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"conversation {i}, message {j} must be a dict with 'role' and 'content', "
                                f"got {type(message).__name__}")
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(f"conversation {i}, message {j} has no {key!r}: keys are {sorted(message)}")
                if not isinstance(message[key], str):
                    raise TypeError(f"conversation {i}, message {j}: {key!r} must be a str, "
                                    f"got {type(message[key]).__name__}")
    return [list(c) for c in conversations]


def render_chat(tokenizer, model_dir: str, messages: object) -> list[str]:
    """One prompt string per conversation in `messages`, rendered by the chat template."""
    conversations = as_conversations(messages)
    if tokenizer is None:
        raise ValueError(f"model directory {model_dir!r} has no tokenizer, so chat() cannot render "
                         "messages: use generate() with token ids")
    if not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of model directory {model_dir!r} has no chat template: "
                         "use generate() with plain prompts")
    return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
