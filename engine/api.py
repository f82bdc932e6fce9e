"""The contract between the built-in engine and everything that drives it (runner, server, tuner).

Pure data, no torch: the load generator, the server and the tuner import these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    stop: list[str] = field(default_factory=list)  # stop strings (never emitted)
    seed: int | None = None
    # vLLM's peer-client fields: end-of-sequence does not end the request (fixed output lengths), and
    # neither it nor a stop string ends one before min_tokens new tokens
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass
class GenStats:
    """What one generation measured. tau counts tokens per target forward over ALL steps
    (prefill forward included, bonus token included), as docs/design.md defines it."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill + every verify/decode forward
    draft_steps: int = 0  # verify forwards that carried at least one drafted token
    drafted_tokens: int = 0  # drafted tokens offered for verification (tree nodes minus root)
    accepted_tokens: int = 0  # drafted tokens accepted (bonus tokens excluded)
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps where depth i+1 was accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only, stop string / EOS excluded
    text: str
    finish_reason: Literal["stop", "length"]
    stats: GenStats


# Called with each batch of newly committed tokens (one per target forward under speculation).
TokenCallback = Callable[[list[int]], None]


class TextEngine(Protocol):
    """What the runner and the server need from an in-process engine."""

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_tokens: TokenCallback | None = None) -> GenResult: ...

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]: ...

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]: ...

    def batcher(self) -> Any:
        """The scheduler of its requests (engine.decode.batch.BatchEngine): `submit`, `step`,
        `cancel`, `abort`, `closed_loop`; the server and the load generator drive it."""
        ...
