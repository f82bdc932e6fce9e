"""Which trainer makes a method's draft: one entry point for every trained method, asked of the
method registry (EAGLE / EAGLE-3 heads through the head pipeline, Medusa heads, draft models)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.heads.draft_model_train import ensure_draft_model
from engine.heads.medusa_train import ensure_medusa
from engine.heads.pipeline import TrainJob, ensure_head
from engine.heads.schedule import Report
from tuner.schema.config import UserError, WorkloadConfig
from tuner.schema.methods import METHODS


def ensure_draft(job: TrainJob, method: str, engine=None, retrain: bool = False,
                 workloads: Sequence[WorkloadConfig] = (), report: Report | None = None) -> Path:
    """The directory of the job's trained draft of `method`: cached, or trained now (retrain=True
    trains again). `workloads` are the other packaged workloads, whose held-out prompts are kept out
    of the data too."""
    kind = METHODS[method].trained_by if method in METHODS else None
    if kind == "eagle":
        return ensure_head(job, engine, retrain, workloads, report, method)
    if kind == "medusa":
        return ensure_medusa(job, engine, retrain, workloads, report)
    if kind == "draft_model":
        return ensure_draft_model(job, engine, retrain, workloads, report)
    trained = [m.name for m in METHODS.values() if not m.training_free]
    raise UserError(f"spec.method={method}: not a trained draft (train-draft trains {', '.join(trained)})")
