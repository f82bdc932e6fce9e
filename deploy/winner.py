"""Which SpecConfig a deployment target serves: the study's winner, adapted to what the target can run.

An adaptive winner (spec.adaptive) is served adaptively where the pinned release of the target runs
it for its method (tuner.schema.flags' tables), else the study's best static schedule, measured
second best, is served instead. vLLM verifies chains only (a tree winner is replaced by the study's
best chain); SGLang serves
EAGLE / EAGLE-3 heads only (another method is replaced by a head from the model's
draft_sources). A drafter must have a source a pod can reach: a hub repository (vLLM and SGLang
pull it themselves; for the built-in server an init container downloads it into the model volume)
or a path inside the model volume. A path on the tuning machine is refused, naming
`tuner push-head`, which uploads it. Every adaptation is reported as one line in `notes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from tuner.schema.config import BestResult, Config, SpecConfig, UserError
from tuner.schema.engine_command import pinned_version
from tuner.schema.flags import (SGLANG_ADAPTIVE_FIRST, SGLANG_ADAPTIVE_METHODS, adaptive_steps, sglang_adaptive,
                                vllm_adaptive_methods)
from tuner.schema.methods import METHODS, engine_methods, engine_refusal, head_methods

MODEL_DIR = "/models"  # mount point of the model-cache volume in every pod
DRAFTS_DIR = f"{MODEL_DIR}/drafts"  # where the built-in server's hub drafters are downloaded


@dataclass(frozen=True)
class Served:
    """The spec a target serves, the study's winner it came from, and why they differ."""

    spec: SpecConfig
    tuned: SpecConfig
    notes: tuple[str, ...] = ()
    fetches: tuple[tuple[str, str], ...] = ()  # (hub repository, pod path): downloaded before the server starts


def _with(spec: SpecConfig, **update: object) -> SpecConfig:
    return SpecConfig.model_validate({**spec.model_dump(), **update})


def _is_local(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~"))


@dataclass(frozen=True)
class WinnerOverride:
    """`tuner render --from RUN spec.depth=5`: the winner (and its best chain, while it stays one)
    with the command line's spec.* overrides applied (tuner.run.rundir.winner_override)."""

    spec: SpecConfig
    chain: SpecConfig | None
    given: tuple[str, ...]
    chain_error: str | None = None  # why the overrides leave no valid chain (said when vLLM would serve it)


def adaptive_refusal(cfg: Config, spec: SpecConfig) -> str | None:
    """Why deploy.target's pinned release cannot size `spec`'s drafts per step itself, or None when it
    can (the built-in server always can)."""
    target, tag = cfg.deploy.target, cfg.deploy.image_tag
    version = pinned_version(tag)
    if target == "vllm":
        methods = vllm_adaptive_methods(version)
        if METHODS[spec.method].vllm in methods:
            return None
        return (f"vLLM {version} (deploy.image_tag={tag}) verifies adaptively (enable_adaptive_verification) only "
                f"for method {', '.join(sorted(methods)) or 'none'}")
    if target == "sglang":
        how = sglang_adaptive(version)
        if how is None:
            return (f"SGLang {version} (deploy.image_tag={tag}) has no --speculative-adaptive "
                    f"(from {SGLANG_ADAPTIVE_FIRST})")
        if spec.method not in SGLANG_ADAPTIVE_METHODS or spec.topk != 1:
            return f"SGLang {version} adapts EAGLE / EAGLE-3 chains only (topk=1)"
        if not adaptive_steps(spec.depth, how.zero_steps)[1:]:
            return f"SGLang {version} needs two step counts to switch between and depth {spec.depth} leaves one"
    return None


def _static_instead(cfg: Config, spec: SpecConfig, best: BestResult | None, why: str) -> tuple[SpecConfig, str]:
    """The study's best static schedule (the second best to an adaptive winner), or off when no
    static schedule beat off, and the line saying so; refused without a study that measured both."""
    arms = best.arms if best is not None else None
    if arms is None:
        raise UserError(f"'{spec.key()}' cannot be served adaptively by deploy={cfg.deploy.target}: {why}, and no study "
                        "measured a static schedule to serve instead: give spec.adaptive=false (or render --from a "
                        "run that searched search.adaptive)")
    head = f"winner '{spec.key()}' sizes its drafts per step on the built-in engine; {why}: serving "
    if arms.static is None or not arms.static_beats_off:
        return SpecConfig(method="off"), head + "speculation off, second best in the study (no static schedule beat it)"
    versus = (f", {arms.static_speedup:.3f}x against the adaptive {arms.adaptive_speedup:.3f}x"
              if arms.static_speedup is not None and arms.adaptive_speedup is not None else "")
    bands = " with its tuned K per batch size (k_per_batch_size)" if arms.static.k_per_batch_size else ""
    return arms.static, (f"{head}the static schedule the study measured second best, '{arms.static.key()}'{bands}"
                         f"{versus}")


def served_spec(cfg: Config, best: BestResult | None, override: WinnerOverride | None = None) -> Served:
    """Resolve the spec to serve for cfg.deploy.target from best.yaml (or cfg.spec without one);
    `override`: the winner with spec.* overrides applied, served instead (and said so in a note)."""
    tuned = best.spec if best is not None else cfg.spec
    spec, notes = (override.spec if override is not None else tuned), []
    if override is not None:
        notes.append(f"{' '.join(override.given)} on top of the winner '{tuned.key()}': serving '{spec.key()}' "
                     "(not measured: re-measure to confirm the speedup)")
    target, model = cfg.deploy.target, cfg.model
    pj = best.projection if best is not None else None
    if pj is not None:
        notes.append(f"projected for {pj.hardware} from the acceptance profile {pj.profile} (predicted "
                     f"{pj.predicted_speedup:.2f}x, not measured there): re-measure there to confirm the speedup")
    elif best is not None and (best.provenance.model, best.provenance.hardware) != (model.name, cfg.hardware.name):
        notes.append(f"winner tuned for model {best.provenance.model} on {best.provenance.hardware}, rendered for "
                     f"{model.name} on {cfg.hardware.name}: re-measure there to confirm the speedup (or render "
                     "--projected for the configuration its acceptance profile predicts there)")

    if spec.adaptive and spec.method != "off":
        why = adaptive_refusal(cfg, spec)
        if why is not None:
            spec, note = _static_instead(cfg, spec, best, why)
            notes.append(note)

    if target == "vllm" and spec.method != "off" and spec.topk != 1:
        chain = override.chain if override is not None else best.chain_spec if best is not None else None
        if chain is None and override is not None and override.chain_error:
            raise UserError(override.chain_error)
        if chain is None and override is not None:
            raise UserError(f"{' '.join(override.given)}: '{spec.key()}' is a tree (topk={spec.topk}) and vLLM "
                            "verifies chains only: give spec.topk=1 (or render deploy=sglang)")
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

    refusal = engine_refusal(spec.method, spec.topk, "sglang")
    if target == "sglang" and refusal is not None:
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
            # the registry's reason (e.g. SGLang runs n-gram only as a tree), and what can be served instead
            tree = (f"spec.topk=2 (an n-gram tree, not measured) or " if spec.method == "ngram" and spec.topk == 1
                    else "")
            raise UserError(
                f"'{spec.key()}' cannot be served by deploy=sglang: {refusal}; model {model.name} lists no "
                f"draft_sources.eagle3/eagle to serve instead: give {tree}spec.method=eagle3 spec.head_path=HEAD"
            )

    if spec.method in head_methods() and not spec.head_path:
        sources = getattr(model.draft_sources, spec.method, [])
        if not sources:
            raise UserError(
                f"spec.head_path is required for spec.method={spec.method}: model {model.name} lists no "
                f"draft_sources.{spec.method} (train one with `tuner train-draft` or give spec.head_path=HEAD)"
            )
        notes.append(f"spec.head_path unset: serving {spec.method} head {sources[0]} from model.draft_sources")
        spec = _with(spec, head_path=sources[0])

    field = METHODS[spec.method].draft_field
    ref = getattr(spec, field) if field else None
    fetches: list[tuple[str, str]] = []
    if spec.method != "off" and ref:
        if _is_local(ref) and not PurePosixPath(ref).is_relative_to(MODEL_DIR):
            raise UserError(
                f"spec.{field}={ref} is a path on this machine that no pod can read: upload it with `tuner push-head "
                f"{ref} --to ORG/NAME` and render with spec.{field}=ORG/NAME (`tuner push-head RUN_DIR --to ORG/NAME` "
                "also records it in the run's best.yaml and re-renders)")
        if _is_local(ref):
            notes.append(f"spec.{field}={ref}: expected in the model volume (mounted at {MODEL_DIR})")
        elif target == "builtin":  # vLLM / SGLang download a hub drafter themselves; tuner serve loads a directory
            pod_ref = f"{DRAFTS_DIR}/{ref.replace('/', '--')}"
            fetches.append((ref, pod_ref))
            notes.append(f"spec.{field}={ref}: downloaded from the hub into {pod_ref} by the pod's init container")
            spec = _with(spec, **{field: pod_ref})
    return Served(spec=spec, tuned=tuned, notes=tuple(notes), fetches=tuple(fetches))
