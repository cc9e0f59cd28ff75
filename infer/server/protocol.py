"""Request bodies of the OpenAI API (the fields the engine supports) plus vLLM's
extras, and their translation to SamplingParams.

Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI
fields keep working; fields we cannot honour when set are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..core.sampling_params import SamplingParams
from ..core.structured import StructuredOutputsParams
from .errors import APIError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows 20 top_logprobs too
MAX_N = 128  # completions per prompt: each is a sequence in the batch, so a huge n is a denial of service


def _unicode_problem(value: Any, path: str) -> tuple[str, str] | None:
    """(field path, message) for the first string in `value` that is not valid Unicode:
    JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate, which no tokenizer takes."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, (f"{path or 'the request'} holds a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x} at "
                          f"character {exc.start}), which is not valid Unicode; send text as valid UTF-8 or pair "
                          "the surrogate")
        return None
    if isinstance(value, BaseModel):
        items = [(k, getattr(value, k)) for k in type(value).model_fields] + list((value.model_extra or {}).items())
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and not key.isascii():
            found = _unicode_problem(key, path)
            if found:
                return found
        found = _unicode_problem(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class _ValidText(BaseModel):
    """Refuses (400, naming the field) a body whose strings are not valid Unicode."""

    @model_validator(mode="after")
    def _valid_unicode(self):
        found = _unicode_problem(self, "")
        if found:
            raise APIError(400, found[1], found[0])
        return self


@dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask for (`infer serve --max-prompts-per-request`,
    `--max-sequences-per-request`): each prompt, and each of its n completions, is a
    sequence in the engine's batch, so one request must not queue thousands."""

    max_prompts: int = 256
    max_sequences: int = 1024

    def check(self, num_prompts: int, n: int) -> None:
        if num_prompts > self.max_prompts:
            raise APIError(400, f"{num_prompts} prompts in one request exceed the server's limit of "
                           f"{self.max_prompts} (--max-prompts-per-request); send them in several requests", "prompt")
        if num_prompts * n > self.max_sequences:
            raise APIError(400, f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences exceed the server's "
                           f"limit of {self.max_sequences} per request (--max-sequences-per-request)", "n")

    def check_pooling(self, num_inputs: int) -> None:
        """Inputs of one embeddings, score or rerank request: each is a sequence in the batch."""
        if num_inputs > self.max_sequences:
            raise APIError(400, f"{num_inputs} inputs in one request exceed the server's limit of {self.max_sequences} "
                           "(--max-sequences-per-request); send them in several requests", "input")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_ValidText):
    """Fields shared by completions and chat completions."""

    # NaN and infinities (which Python's JSON parser accepts) are never valid sampling values.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="served model name; the first served model when omitted")
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Bounded so that they fit the engine's int64/int32 sampling tensors.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # OpenAI's range
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The request's grammar, from whichever one field sets it; 400 naming the field when it is malformed."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        rf = self.response_format
        rf_type = rf.get("type", "text") if isinstance(rf, dict) else "text"
        sources = [name for name, on in (("response_format", rf_type != "text"),
                                         ("structured_outputs", self.structured_outputs is not None),
                                         ("guided_*", bool(guided))) if on]
        if len(sources) > 1:
            raise APIError(400, f"set one of {' and '.join(sources)}, not both", sources[1])
        try:
            if rf_type == "json_object":
                return StructuredOutputsParams(json_object=True, source="response_format")
            if rf_type == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                                   "response_format.json_schema.schema")
                return StructuredOutputsParams(json=schema, source="response_format.json_schema")
            if rf_type != "text":
                raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {rf_type!r}",
                               "response_format.type")
            if self.structured_outputs is not None:
                return StructuredOutputsParams.coerce(self.structured_outputs)
            if len(guided) > 1:
                raise APIError(400, f"set one of {', '.join('guided_' + k for k in guided)}", "guided_" + list(guided)[1])
            for kind, value in guided.items():
                return StructuredOutputsParams(**{kind: value}, whitespace_pattern=self.guided_whitespace_pattern,
                                               source=f"guided_{kind}")
        except ValueError as exc:
            field = sources[0] if sources[0] != "guided_*" else f"guided_{next(iter(guided))}"
            raise APIError(400, str(exc), field) from None
        return None

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams for this request; `defaults` is the model's generation_config.

        Sampling knobs the request leaves unset take the model's defaults, as
        vLLM does with ``--generation-config auto``.
        """
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        try:
            return SamplingParams(
                n=self.n, temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                top_k=int(pick("top_k", 0)), min_p=float(pick("min_p", 0.0)),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=float(pick("repetition_penalty", 1.0)), seed=self.seed,
                max_tokens=self._max_tokens(), min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self._num_logprobs(),
                logit_bias=bias, skip_special_tokens=self.skip_special_tokens,
                structured_outputs=self.structured_spec(),
            )
        except ValueError as exc:  # "SamplingParams.top_p must be in (0, 1], got 5.0"
            msg = str(exc)
            param = msg.split(" ", 1)[0].removeprefix("SamplingParams.") if msg.startswith("SamplingParams.") else None
            raise APIError(400, msg.replace("SamplingParams.", ""), param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def prompts(self) -> list[str | dict]:
        """The prompts as the engine takes them: text, or {'prompt_token_ids': [...]}."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [{"prompt_token_ids": list(p)}]
        else:
            items = [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]
        if not items:
            raise APIError(400, "prompt must not be empty", "prompt")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        return items


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the template reads it; content parts stay a list (text and images:
        `ServedModel.chat_prompt` joins a text model's, loads a VLM's images)."""
        msg = self.model_dump(exclude_none=True)
        msg.setdefault("content", "")
        if msg["role"] == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        return msg


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; default: auto with tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_ValidText):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
