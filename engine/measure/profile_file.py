"""The stored acceptance profile (profile.json): its schema, reader and writer, apart from the code
that measures it (engine.measure.profile), so that projecting and rendering from a profile need no
PyTorch (engine/__init__.py imports nothing)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tuner.schema.config import SpecConfig, UserError

PROFILE_FILE = "profile.json"
KIND = "spectune-acceptance-profile"


@dataclass
class Profile:
    """A stored acceptance profile: where it came from and every profiled point."""

    model: str
    hf_id: str
    fp8: bool
    workload: str
    temperature: float
    max_new_tokens: int
    prompts: list[str]
    sequences: list[dict]
    points: list[dict]
    reference_s: float = 0.0
    engine: str = ""  # dtype / threads / device of the built-in engine that profiled (its draft times)
    kind: str = KIND

    @property
    def exact(self) -> bool:
        return self.temperature <= 0

    def tau(self, spec: SpecConfig) -> float | None:
        """The profiled tau of `spec` (method, depth, topk, budget, n-gram lookup), or None."""
        hit = self.point(spec)
        return hit["tau"] if hit else None

    def point(self, spec: SpecConfig) -> dict | None:
        want = _identity(spec)
        return next((p for p in self.points if _identity(SpecConfig(**p["spec"])) == want), None)

    def save(self, path: Path) -> Path:
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / PROFILE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)
        return path


def _identity(spec: SpecConfig) -> tuple:
    # what acceptance depends on (not the K schedule, which is a cost decision)
    lookup: tuple = ()
    if spec.method == "ngram":
        lookup = (spec.ngram_min, spec.ngram_max) + ((spec.ngram_match,) if spec.topk > 1 else ())
    elif spec.method == "suffix":
        lookup = (spec.suffix_tree_depth, spec.suffix_spec_factor, spec.suffix_min_prob, spec.suffix_max_requests)
    if spec.method == "off":
        return ("off",)
    return (spec.method, spec.depth, spec.topk, spec.budget, *lookup)


def load_profile(path: str | Path) -> Profile:
    """A profile from its file or the run directory holding profile.json (UserError when unreadable)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / PROFILE_FILE
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--profile {path}: no readable acceptance profile ({type(exc).__name__}); "
                        "make one with `tuner profile`") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise UserError(f"--profile {path}: not an acceptance profile written by `tuner profile`")
    return Profile(**data)
