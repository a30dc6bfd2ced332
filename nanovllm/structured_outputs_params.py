"""vLLM's StructuredOutputsParams, the formal language a completion must follow (importable from
nanovllm.sampling_params too, where vLLM has it).

Invariant once constructed (SamplingParams.validated rebuilds it, so an edited one is checked
again): exactly one constraint is set, in its field's shape; the contents (a schema, regex or
grammar xgrammar rejects) are checked where the grammar is compiled (engine/structured_outputs.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nanovllm.utils.validation import check_bool, check_text


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a formal language (vLLM's structured outputs). Exactly one of:

    json: a JSON schema (a dict, or its JSON text): the completion is JSON valid against it.
    regex: the whole completion matches this regular expression.
    choice: the completion is one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF-style syntax, start rule `root`), or, where no rule is
        written with `::=`, a Lark grammar (start rule `start`), as vLLM's xgrammar backend reads them.
    json_object: True: the completion is a JSON object.

    disable_any_whitespace: JSON (json / json_object) without optional whitespace; by default any
        whitespace JSON allows may come between its tokens.

    vLLM's other options are taken where they ask for what xgrammar, the only backend here, does
    anyway, and refused by name otherwise (ValueError): disable_additional_properties (either bool:
    xgrammar's strict mode allows no property a schema does not name, as vLLM's xgrammar backend
    compiles it), disable_fallback (either bool: there is no other backend to fall back to),
    whitespace_pattern (None only: xgrammar takes no whitespace regex; disable_any_whitespace is its
    switch) and structural_tag (None only: not supported). They are kept as given, as vLLM's fields are.
    EOS ends a constrained completion only where the language allows the text to end. The shape
    is checked here; the contents (a bad regex, schema or grammar) when the request is added,
    where the grammar is compiled (engine/structured_outputs.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # vLLM's options for its other backends (class docstring): accepted where they change nothing here.
    disable_additional_properties: bool = False
    whitespace_pattern: None = None
    structural_tag: None = None
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        for name in ("disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StructuredOutputsParams.{name} must be a bool, got {getattr(self, name)!r:.200}")
        if self.whitespace_pattern is not None:
            raise ValueError(f"StructuredOutputsParams.whitespace_pattern={self.whitespace_pattern!r:.200} is not "
                             "supported: xgrammar, the only grammar backend here, takes no whitespace pattern (vLLM's "
                             "xgrammar backend does not apply one either); disable_any_whitespace=True makes JSON compact")
        if self.structural_tag is not None:
            raise ValueError(f"StructuredOutputsParams.structural_tag={self.structural_tag!r:.200} is not supported: "
                             "pass json, regex, choice, grammar or json_object")
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                check_text("StructuredOutputsParams.json", self.json)  # the compiler takes UTF-8
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not JSON text ({e}): {self.json!r:.200}") from e
            else:
                schema = self.json
            if isinstance(schema, bool) or not isinstance(schema, dict):
                raise TypeError(f"StructuredOutputsParams.json must be a JSON schema object (a dict or its "
                                f"JSON text), got {self.json!r:.200}")
            if not isinstance(self.json, str):  # the compiler takes the dict as JSON text
                try:
                    json.dumps(schema, allow_nan=False)
                except (TypeError, ValueError) as e:
                    raise TypeError(f"StructuredOutputsParams.json is not JSON data ({e}): {self.json!r:.200}") from e
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r:.200}")
            if value is not None:  # the grammar compiler takes UTF-8
                check_text(f"StructuredOutputsParams.{name}", value)
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise TypeError(f"StructuredOutputsParams.choice must be a non-empty list of strings, "
                                f"got {self.choice!r:.200}")
            self.choice = list(self.choice)
            for choice in self.choice:
                check_text("StructuredOutputsParams.choice entry", choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True (or None: not asked), "
                             f"got {self.json_object!r}")
        check_bool("StructuredOutputsParams.disable_any_whitespace", self.disable_any_whitespace)
