"""Speculative decoding: a proposer drafts the next tokens of each decoding request,
and one step of the target model verifies them all.

The engine asks the proposer for drafts before it schedules a step; the
scheduler gives a request with k drafts a query of 1 + k tokens (its last token
and the drafts) with KV slots for all of them; `sample` verifies every draft
position (step 6 of `SamplingTensors`: accept with min(1, p/q), else a token of
the residual distribution), and the request takes the accepted drafts plus the
token after them. KV written for rejected drafts lies past the request's
computed tokens, so the next step overwrites it; prefix-cache hashes cover only
computed tokens. Proposers register through the pluggy hook
`infer_register_spec_proposers` under their ``method``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np

from ..primitives.hookspecs import hookimpl


@dataclass
class SpeculativeConfig:
    """``--speculative-config`` / ``LLM(speculative_config=...)``, with vLLM's keys.

    method                  a registered proposer: "ngram" (prompt lookup).
    num_speculative_tokens  drafts per step and request (k).
    prompt_lookup_max/min   n-gram: the longest and shortest suffix looked up
                            in the request's own tokens (longest first).
    disable_by_batch_size   no drafts while this many requests or more are
                            running (verifying costs compute a full batch lacks);
                            None: 8 on host backends, never on accelerators.
    model                   the draft model of "draft_model".
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    model: str | None = None
    extra: dict = field(default_factory=dict, repr=False)  # keys a plugin's proposer reads

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (None stays None); ValueError names the bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        from ..registry import get_spec_proposer

        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        proposer = get_spec_proposer(value["method"])  # raises, naming the known methods
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(value) - known - set(getattr(proposer, "extra_keys", ())))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        cfg = cls(**{k: v for k, v in value.items() if k in known},
                  extra={k: v for k, v in value.items() if k not in known})
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={cfg.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={cfg.prompt_lookup_max}")
        d = cfg.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {d!r}")
        return cfg


class Proposer:
    """Drafts tokens for requests. `method` is the name it registers under;
    `extra_keys` the config keys beyond SpeculativeConfig's it reads (from `extra`)."""

    method = ""
    extra_keys: tuple[str, ...] = ()

    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config

    def propose(self, token_ids: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[i] tokens to follow token_ids[i] (a request's prompt and
        output so far), for each request; [] where there is nothing to propose."""
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of
    the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)."""

    method = "ngram"

    def propose(self, token_ids: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        return [self._lookup(ids, k) if k > 0 else [] for ids, k in zip(token_ids, max_drafts)]

    def _lookup(self, ids: list[int], k: int) -> list[int]:
        c = self.config
        tokens = np.asarray(ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(c.prompt_lookup_max, total - 1), c.prompt_lookup_min - 1, -1):
            # Windows ending before the last token: each has a continuation, and the
            # suffix itself is not among them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


@dataclass
class SpecDecodeStats:
    """Counters of verified drafts (the Prometheus metrics `infer:spec_decode_*`)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted drafts at each position

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gave a request on average (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@hookimpl
def infer_register_spec_proposers() -> dict[str, type]:
    return {NgramProposer.method: NgramProposer}
