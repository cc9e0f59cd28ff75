"""SamplingParams with vLLM's names, defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from .structured import StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._verify()

    def _verify(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            bad("top_k", "must be an integer in [0, 2**31) (0 or -1 disables)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be >= 0 and <= max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be >= 0")
        if any(not s for s in self.stop_strings):
            bad("stop", "must not contain empty strings")
        # Seeds travel to the backends as int64.
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            bad("seed", "must be an integer in [-2**63, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
