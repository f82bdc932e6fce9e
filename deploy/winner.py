"""Which SpecConfig a deployment target serves: the study's winner, adapted to what the target can run.

vLLM verifies chains only (a tree winner is replaced by the study's best chain); SGLang serves
EAGLE / EAGLE-3 heads only (another method is replaced by a head from the model's
draft_sources); a drafter that lives on the tuning machine is expected in the pod's cache volume.
Every adaptation is reported as one line in `notes` so the CLI can say what it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from tuner.schema import BestResult, Config, SpecConfig, UserError

MODEL_DIR = "/models"  # mount point of the model-cache volume in every pod
DRAFTS_DIR = f"{MODEL_DIR}/drafts"  # where locally trained heads / draft models are copied
SGLANG_SERVABLE = ("off", "eagle", "eagle3")
HEAD_METHODS = ("eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class Served:
    """The spec a target serves, the study's winner it came from, and why they differ."""

    spec: SpecConfig
    tuned: SpecConfig
    notes: tuple[str, ...] = ()


def _with(spec: SpecConfig, **update: object) -> SpecConfig:
    return SpecConfig.model_validate({**spec.model_dump(), **update})


def _is_local(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~"))


def served_spec(cfg: Config, best: BestResult | None) -> Served:
    """Resolve the spec to serve for cfg.deploy.target from best.yaml (or cfg.spec without one)."""
    tuned = best.spec if best is not None else cfg.spec
    spec, notes = tuned, []
    target, model = cfg.deploy.target, cfg.model
    if best is not None and (best.provenance.model, best.provenance.hardware) != (model.name, cfg.hardware.name):
        notes.append(f"winner tuned for model {best.provenance.model} on {best.provenance.hardware}, rendered for "
                     f"{model.name} on {cfg.hardware.name}: re-measure there to confirm the speedup")

    if target == "vllm" and spec.method != "off" and spec.topk != 1:
        chain = best.chain_spec if best is not None else None
        if chain is None:
            raise UserError(
                f"winner '{spec.key()}' is a tree (topk={spec.topk}) and vLLM verifies chains only; "
                "best.yaml has no chain_spec (tune with engine=vllm, or render deploy=sglang)"
            )
        notes.append(
            f"winner '{spec.key()}' is a tree (topk={spec.topk}); vLLM verifies chains only: "
            f"serving the study's best chain '{chain.key()}'"
        )
        spec = chain

    if target == "sglang" and spec.method not in SGLANG_SERVABLE:
        for method in ("eagle3", "eagle"):
            sources = getattr(model.draft_sources, method)
            if sources:
                notes.append(
                    f"spec.method={spec.method} is not served by SGLang: serving {method} head {sources[0]} "
                    f"from model.draft_sources with depth={spec.depth} topk={spec.topk} budget={spec.budget} "
                    "(not tuned for this head)"
                )
                spec = _with(spec, method=method, head_path=sources[0])
                break
        else:
            raise UserError(
                f"spec.method={spec.method} cannot be served by deploy=sglang (allowed: {', '.join(SGLANG_SERVABLE)}) "
                f"and model {model.name} lists no draft_sources.eagle3/eagle: give spec.method=eagle3 spec.head_path=HEAD"
            )

    if spec.method in HEAD_METHODS and not spec.head_path:
        sources = getattr(model.draft_sources, spec.method, [])
        if not sources:
            raise UserError(
                f"spec.head_path is required for spec.method={spec.method}: model {model.name} lists no "
                f"draft_sources.{spec.method} (train one with `tuner train-draft` or give spec.head_path=HEAD)"
            )
        notes.append(f"spec.head_path unset: serving {spec.method} head {sources[0]} from model.draft_sources")
        spec = _with(spec, head_path=sources[0])

    field = "draft_model" if spec.method == "draft_model" else "head_path"
    ref = getattr(spec, field)
    if spec.method != "off" and ref and _is_local(ref):
        pod_ref = f"{DRAFTS_DIR}/{PurePosixPath(ref).name}"
        notes.append(f"spec.{field}={ref} is a local path: copy it into the model-cache volume at {pod_ref}")
        spec = _with(spec, **{field: pod_ref})
    return Served(spec=spec, tuned=tuned, notes=tuple(notes))
