"""The speculative configuration (`SpecConfig`: what the tuner searches and a deployment serves),
and what every schema model shares: strict models (an unknown key is
a user error) and `UserError`. Part of the one config schema: import these from `tuner.schema.config`.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tuner.schema.methods import SpecMethod, can_branch


class UserError(Exception):
    """A mistake in the user's input: printed as one line by the CLI, exit code 2."""


class Strict(BaseModel):
    # Unknown keys are user errors (a typo in an override must not be ignored silently).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, v: object, info: ValidationInfo) -> object:
        # pydantic reads true as 1 for a number: `spec.depth=true` would silently mean depth 1
        if isinstance(v, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            kinds = set(get_args(annotation)) if get_args(annotation) else {annotation}
            if kinds & {int, float} and bool not in kinds:
                raise ValueError(f"{str(v).lower()} given where a number is expected")
        return v


TREE_BUDGET = 5  # a tree's budget when none is given (a chain's is always depth+1)


class SpecConfig(Strict):
    """One speculative configuration: the thing the tuner searches and the deployment serves.

    depth: draft steps (SGLang --speculative-num-steps, vLLM num_speculative_tokens).
    topk: branching per node (SGLang --speculative-eagle-topk); 1 means a chain.
    budget: tree nodes verified per step including the root (SGLang --speculative-num-draft-tokens).
    """

    method: SpecMethod = "off"
    depth: int = Field(4, ge=1, le=16)
    topk: int = Field(1, ge=1, le=16)
    # None or not given: derived (see _derive_budget): depth+1 for a chain, TREE_BUDGET for a tree
    budget: int = Field(TREE_BUDGET, ge=2, le=256)
    draft_model: str | None = None  # draft_model: local HF dir or HF id
    head_path: str | None = None  # eagle / eagle3 / medusa: head checkpoint dir or HF id
    ngram_min: int = Field(2, ge=1, le=16)  # n-gram prompt lookup: shortest match
    ngram_max: int = Field(4, ge=1, le=16)  # n-gram prompt lookup: longest match
    # n-gram trees (topk > 1, SGLang NGRAM --speculative-ngram-match-type): "bfs" takes the topk most
    # frequent continuations per level, "prob" the most probable nodes (frequency ratios) best first
    ngram_match: Literal["bfs", "prob"] = "bfs"
    # SuffixDecoding (vLLM suffix_decoding_*): the depth of its suffix trees (match + speculation),
    # speculated tokens <= suffix_spec_factor * match length, tokens below suffix_min_prob dropped,
    # the global tree over the last suffix_max_requests responses (0: no global tree)
    suffix_tree_depth: int = Field(24, ge=2, le=64)
    suffix_spec_factor: float = Field(1.0, gt=0, le=16)
    suffix_min_prob: float = Field(0.1, ge=0, le=1)
    suffix_max_requests: int = Field(10000, ge=0, le=1_000_000)
    # vLLM dynamic K: [[min_batch, max_batch, K], ...], inclusive ranges, K <= depth.
    k_per_batch_size: list[tuple[int, int, int]] | None = None
    # the built-in engine sizes each request's draft every step from its observed acceptance and the
    # measured step cost; depth and budget are then the bounds it chooses within (0 drafted included)
    adaptive: bool = False

    @model_validator(mode="before")
    @classmethod
    def _derive_budget(cls, data: object) -> object:
        # conf/config.yaml leaves spec.budget null, so a budget here is one the user gave; a chain's
        # is then derived (depth+1, the only valid value), a tree's is TREE_BUDGET.
        if isinstance(data, dict) and data.get("budget") is None:
            depth, topk = data.get("depth", 4), data.get("topk", 1)
            if isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 16:
                chain = topk == 1 or topk == "1"
                data = {**data, "budget": depth + 1 if chain else TREE_BUDGET}
            else:
                data = {k: v for k, v in data.items() if k != "budget"}  # depth's own error is reported
        return data

    @model_validator(mode="after")
    def _rules(self) -> "SpecConfig":
        if self.method == "off":
            if self.adaptive:
                raise ValueError("spec.adaptive=true with spec.method=off: adaptive sizes a drafter's drafts, "
                                 "choose a method (ngram, suffix, recycle, draft_model, eagle, eagle3, medusa)")
            return self
        if self.adaptive and self.k_per_batch_size is not None:
            raise ValueError("spec.adaptive=true with spec.k_per_batch_size: both choose the draft length, "
                             "give one of them (adaptive bounds it by spec.depth)")
        if self.topk == 1 and self.budget != self.depth + 1:
            raise ValueError(
                f"spec.budget={self.budget} with spec.topk=1 must equal spec.depth+1={self.depth + 1} "
                "(a chain verifies every drafted token plus the root)"
            )
        if self.budget > 1 + self.depth * self.topk:
            raise ValueError(
                f"spec.budget={self.budget} exceeds 1 + depth*topk = {1 + self.depth * self.topk} "
                "(the tree cannot hold more nodes than were drafted)"
            )
        if self.topk != 1 and not can_branch(self.method):
            raise ValueError(f"spec.topk={self.topk} with spec.method={self.method}: its drafter drafts a chain, topk must be 1")
        if self.method == "suffix" and self.depth >= self.suffix_tree_depth:
            raise ValueError(
                f"spec.depth={self.depth} with spec.method=suffix must be < spec.suffix_tree_depth={self.suffix_tree_depth} "
                "(the tree depth bounds the match plus the speculation, and a match has at least one token)"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"spec.ngram_min={self.ngram_min} > spec.ngram_max={self.ngram_max}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("spec.draft_model is required when spec.method=draft_model (a local HF dir or HF id)")
        if self.k_per_batch_size is not None:
            prev_hi = 0
            for lo, hi, k in self.k_per_batch_size:
                if not (lo == prev_hi + 1 and hi >= lo and 0 <= k <= self.depth):
                    raise ValueError(
                        f"spec.k_per_batch_size={self.k_per_batch_size}: ranges must be contiguous from 1, "
                        f"inclusive, each K in [0, depth={self.depth}]"
                    )
                prev_hi = hi
        return self

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def remembers_requests(self) -> bool:
        """Whether its drafter keeps what earlier requests generated (SuffixDecoding's global tree):
        a pass then depends on the passes before it, so each one must start from a known cache."""
        return self.method == "suffix" and self.suffix_max_requests > 0

    def key(self) -> str:
        """Short human-readable identity, e.g. 'eagle d5 k4 b8' or 'off'."""
        if self.method == "off":
            return "off"
        key = f"{self.method} d{self.depth} k{self.topk} b{self.budget}"
        if self.method == "ngram" and self.topk > 1 and self.ngram_match != "bfs":
            key += f" {self.ngram_match}"
        if self.method == "suffix":
            key += f" f{self.suffix_spec_factor:g} p{self.suffix_min_prob:g}"
        if self.adaptive:
            key += " adaptive"
        return key
