"""Chat conversations to prompts, for `LLM.chat` (vLLM's meaning).

A conversation is a list of {"role": str, "content": ...} dicts, the content a string, None or left
out (an assistant turn of tool calls), or a list of {"type": "text" | "input_text" | "output_text",
"text": str} parts ({"type": "refusal", "refusal": str} and {"type": "thinking", "thinking": str}
too: TEXT_PARTS) or bare strings; other keys (tool_calls, name, ...) reach the template as given, but for an
assistant's tool calls (function calls), whose arguments (a JSON string in OpenAI's format) reach it
as the dict tool templates render with `tojson` (what the JSON holds; {} for a string that is not JSON), an empty
list of them left out, as vLLM does (`assistant_tool_calls`; other shapes of them are refused). The template
sees the content as vLLM's `chat_template_content_format` says: "string" (parts joined with
newlines; None: ""), "openai" (a list of {"type": "text", "text": ...} parts; a tool message's
content stays one string, as vLLM hands it), or "auto": "openai" for a template that loops over a
message's content (or a variable named `content`), else "string" (`detect_content_format`; of a
tokenizer's named templates, the one it renders with: `tokenizer_template`);
`chat` takes one conversation or a list of them (an empty list is a batch of none: no outputs,
as vLLM's; a conversation of no messages is refused). Each is rendered to text with the checkpoint
tokenizer's chat template (or the one given), then tokenized *without* the tokenizer's special
tokens: the template writes them itself, so a tokenizer that adds a BOS (Llama 3) does not add a
second one. The rendered text is the output's `prompt`. A template that fails (its syntax, an undefined
read, its own raise_exception, or any other error while it renders, such as a TypeError of an
operation in it or transformers' refusal of `tools`) is a ValueError naming the conversation, as vLLM's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from nanovllm.utils.validation import check_bool, check_text

# The content-part types chat takes, as vLLM reads them, each with the key holding its text (OpenAI's
# text and assistant refusal parts, the Responses API's input / output text, vLLM's thinking parts).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# vLLM's chat_template_content_format values.
CONTENT_FORMATS = ("auto", "string", "openai")
# Chat templates whose detected content format is kept (an engine renders with one or two).
TEMPLATES_CACHED = 8


@dataclass(frozen=True)
class ChatOptions:
    """How conversations are rendered (vLLM's LLM.chat arguments). As in vLLM, `chat_template_kwargs`
    (extra template variables: enable_thinking, ...) override the named options they repeat."""

    chat_template: str | None = None  # None: the tokenizer's
    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # leave the last message open, to be continued
    chat_template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None  # tool schemas the template renders (vLLM's `tools`)
    content_format: str = "auto"  # CONTENT_FORMATS: how the template sees a message's content

    def __post_init__(self) -> None:
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(map(repr, CONTENT_FORMATS))}, "
                             f"got {self.content_format!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {self.chat_template_kwargs!r}")
        bad_keys = [key for key in self.chat_template_kwargs if not isinstance(key, str)]
        if bad_keys:  # keyword arguments of the template's render
            raise TypeError(f"chat_template_kwargs keys must be str (template variable names), got {bad_keys[0]!r}")
        if "tokenize" in self.chat_template_kwargs:
            raise ValueError("chat_template_kwargs must not set 'tokenize': chat() renders text and tokenizes it "
                             "itself (without special tokens)")
        kwargs = self.template_kwargs()
        if kwargs["chat_template"] is not None and not isinstance(kwargs["chat_template"], str):
            raise TypeError(f"chat_template must be a str (a Jinja template) or None, got {kwargs['chat_template']!r}")
        for name in ("add_generation_prompt", "continue_final_message"):
            check_bool(name, kwargs[name])
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False: "
                             "the last message cannot be continued and a new turn opened at once")

    def template_kwargs(self) -> dict:
        """The keywords of tokenizer.apply_chat_template (but tokenize): the named options, then
        chat_template_kwargs over them."""
        return {"chat_template": self.chat_template, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "tools": self.tools,
                **self.chat_template_kwargs}


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` (None when the checkpoint has none) carries a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def tokenizer_template(tokenizer, tools: list[dict] | None) -> object:
    """The tokenizer's chat template a conversation renders with, as vLLM resolves it to detect its
    content format: of a dict of named templates, the one transformers picks ("tool_use" with tools,
    else "default"; None where it picks none, which rendering then refuses), not the dict."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, dict):
        return template
    try:
        return tokenizer.get_chat_template(None, tools=tools)
    except ValueError:  # no "default" among the names
        return None


def _content_parts(content: object, where: str) -> list[str]:
    """The texts of a message's content parts (None: none; a string: itself)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{where}: 'content' must be a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise TypeError(f"{where}: 'content' part {k} must be a str or a dict {{'type': 'text', 'text': ...}}, "
                            f"got {type(part).__name__}")
        if part.get("type") not in TEXT_PARTS:
            raise ValueError(f"{where}: 'content' part {k} has type {part.get('type')!r}; only text parts "
                             f"({', '.join(map(repr, TEXT_PARTS))}) are supported")
        key = TEXT_PARTS[part["type"]]
        if not isinstance(part.get(key), str):
            raise TypeError(f"{where}: 'content' part {k} needs a str {key!r}, got {part.get(key)!r}")
        texts.append(part[key])
    return texts


def _content(content: object, where: str, content_format: str) -> str | list[dict]:
    """A message's content as the template sees it: one string (parts joined with newlines), or
    under "openai" a list of text parts."""
    texts = _content_parts(content, where)
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def assistant_tool_calls(tool_calls: object, where: str) -> list[dict]:
    """An assistant message's tool calls as vLLM hands them to the template (its _postprocess_messages):
    each a function call ({"type": "function" or left out, "function": {...}}), its function.arguments
    parsed from OpenAI's JSON string (to whatever the JSON holds, as vLLM's json.loads gives it; {} for
    a string that is not JSON), arguments given as a dict or list kept, {} for None or any other value;
    copies of the calls and functions changed (the caller's stay). A tool_calls that is not a list of
    such dicts is refused naming `where` and the call (vLLM's parsing fails on it, unnamed)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise TypeError(f"{where}: tool_calls must be a list of tool calls, got {type(tool_calls).__name__}")
    out = []
    for k, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise TypeError(f"{where}: tool call {k} must be a dict {{'type': 'function', 'function': {{...}}}}, "
                            f"got {type(call).__name__}")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"{where}: tool call {k} must be a call of type 'function' with a 'function' dict "
                             f"(name, arguments), got {call!r:.200}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


@functools.lru_cache(maxsize=TEMPLATES_CACHED)
def detect_content_format(template: str) -> str:
    """vLLM's "auto" content format of a chat template: "openai" when some loop of it iterates over
    a message's content (`message['content']` / `message.content`, through filters, tests and slices too)
    or over a variable named `content` (`{% for item in content %}`), else "string"; also "string" for a
    template this plain parse cannot read (transformers' {% generation %} tag), whose syntax
    apply_chat_template then judges."""
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:  # loopcontrols: templates use {% break %}
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Name) and it.name == "content":  # `{% for item in content %}`, as vLLM reads it
            return "openai"
        # `m['content'] | selectattr(...)`, `m.content is iterable`, `m['content'][1:]`: vLLM looks through them
        while isinstance(it, (nodes.Filter, nodes.Test)) or (isinstance(it, nodes.Getitem)
                                                             and isinstance(it.arg, nodes.Slice)):
            it = it.node
        if ((isinstance(it, nodes.Getattr) and it.attr == "content")
                or (isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content")):
            return "openai"
    return "string"


def as_conversations(messages: object, content_format: str = "string") -> list[list[dict]]:
    """One conversation or a list of them, as a list of conversations whose contents are in
    `content_format` ("string" or "openai"); an empty list is a batch of none (vLLM's reading), a
    conversation of no messages is refused (transformers cannot render one); malformed input raises
    TypeError/ValueError naming the conversation, message and key at fault."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                        f"got {type(messages).__name__}")
    if isinstance(messages, list) and not messages:  # vLLM's is_list_of(messages, list): an empty batch
        return []
    # one conversation when its first item is a message (an empty tuple: one of no messages, refused below)
    conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
    out = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"conversation {i} is empty")
        checked = []
        for j, message in enumerate(conversation):
            where = f"conversation {i}, message {j}"
            if not isinstance(message, dict):
                raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
            if "role" not in message:
                raise ValueError(f"{where} has no 'role': keys are {sorted(message)}")
            if not isinstance(message["role"], str):
                raise TypeError(f"{where}: 'role' must be a str, got {type(message['role']).__name__}")
            # a tool result is one string under either format, as vLLM hands it (tool templates print it)
            seen_as = "string" if message["role"] == "tool" else content_format
            message = {**message, "content": _content(message.get("content"), where, seen_as)}
            if message["role"] == "assistant" and message.get("tool_calls") is not None:
                message["tool_calls"] = assistant_tool_calls(message["tool_calls"], where)
                if not message["tool_calls"]:  # vLLM drops an empty list: the template's plain assistant path
                    del message["tool_calls"]
            checked.append(message)
        out.append(checked)
    return out


def render_chat(tokenizer, model_dir: str, messages: object, options: ChatOptions) -> list[dict]:
    """One prompt per conversation in `messages` (none for an empty list): {"prompt_token_ids": [...],
    "prompt": text}, the text rendered by the chat template and tokenized without special tokens."""
    if tokenizer is None:
        raise ValueError(f"model directory {model_dir!r}: no tokenizer is loaded (the directory has none, or "
                         "skip_tokenizer_init=True), so chat() cannot render messages: use generate() with token ids")
    kwargs = options.template_kwargs()
    content_format = options.content_format
    if content_format == "auto":
        template = kwargs["chat_template"] or tokenizer_template(tokenizer, kwargs["tools"])
        content_format = detect_content_format(template) if isinstance(template, str) else "string"
    conversations = as_conversations(messages, content_format)
    # an empty batch renders nothing, so needs no template (vLLM returns no outputs)
    if conversations and kwargs["chat_template"] is None and not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of model directory {model_dir!r} has no chat template: "
                         "pass chat_template=..., or use generate() with plain prompts")
    prompts = []
    for i, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        # jinja2's errors (its syntax, an undefined read, its own raise_exception) and any other the template's
        # operations or transformers raise while rendering: a ValueError, as vLLM turns every one of them
        except Exception as e:
            raise ValueError(f"conversation {i}: the chat template failed: {type(e).__name__}: {e}") from e
        check_text(f"conversation {i} (as the chat template rendered it)", text)
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
    return prompts
