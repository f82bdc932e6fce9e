"""`--dry-run` of `tuner optimize` and `tuner bench`: the exact command and environment of the
baseline server and of the first trial's server, printed before anything starts. Nothing is
launched, trained or written: this is how a user checks a GPU run before it spends an hour.
"""

from __future__ import annotations

import shlex

from tuner.schema.config import Config, SpecConfig
from tuner.schema.engine_command import PROGRAMS, builtin_trial_place, engine_command, server_settings
from tuner.schema.methods import head_methods

OFF = SpecConfig(method="off")


def _existing_drafts(cfg: Config) -> tuple[dict[str, str], list[str]]:
    """The drafts a study would use that exist now (no training), and the head methods still to train:
    the order of tuner.study.measurer.get_drafts."""
    from tuner.study.measurer import existing_draft

    found: dict[str, str] = {}
    missing: list[str] = []
    for m in (m for m in cfg.search.methods if m in head_methods()):
        if (draft := existing_draft(cfg, m)) is not None:
            found[m] = draft
        else:
            missing.append(m)
    return found, missing


def first_trial(cfg: Config) -> tuple[SpecConfig | None, str]:
    """The spec of a new study's first trial after the baseline and why it is first, or None and
    the reason it is not known before the study runs."""
    from tuner.search.space import SearchSpace

    drafts, missing = _existing_drafts(cfg)
    space = SearchSpace.from_config(cfg, head_paths={**drafts, **{m: f"<{m} head>" for m in missing}})
    if cfg.search.sampler == "model":
        return None, "search.sampler=model: the first trial is the best point predicted from a profile measured first"
    spec = (space.points() if cfg.search.sampler == "grid" else space.defaults())[0]
    if spec.method in missing:
        return None, (f"the first trial drafts with a {spec.method} head that is trained before it "
                      f"(`tuner train-draft spec.method={spec.method} +workload={cfg.workload.name if cfg.workload else 'NAME'}`)")
    return spec, "the first grid point" if cfg.search.sampler == "grid" else "the first known default"


def server_lines(cfg: Config, spec: SpecConfig, title: str) -> list[str]:
    """A server's command as printed: a title, the variables set on top of the environment, the argv."""
    if cfg.engine.kind == "builtin":
        argv, env = engine_command(server_settings(cfg, "builtin"), spec, builtin_trial_place(cfg))
        title += " (engine=builtin measures in this process; the same engine as a server)"
    else:
        from engine.launch.launcher import local_command, model_ref

        kind = cfg.engine.kind
        argv, env = local_command(kind, getattr(cfg.engine, kind), server_settings(cfg, kind),  # type: ignore[arg-type]
                                  model_ref(cfg.model, cfg.cache_dir), spec, strict=False)
    return [f"{title}:", *(f"  {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            "  " + " ".join(shlex.quote(a) for a in argv)]


def dry_run(cfg: Config, command: str) -> str:
    """What `tuner optimize` (command "optimize") or `tuner bench` ("bench") would start for cfg."""
    lines: list[str] = [f"# tuner {command} --dry-run: engine={cfg.engine.kind} model={cfg.model.name} "
                        f"hardware={cfg.hardware.name}; nothing was started"]
    if command == "optimize" or cfg.bench.baseline:
        lines += server_lines(cfg, OFF, "baseline server (spec.method=off)")
    if command == "optimize":
        spec, why = first_trial(cfg)
        lines += server_lines(cfg, spec, f"first trial's server ({spec.key()}, {why})") if spec else \
            [f"first trial's server: not known yet, {why}"]
    else:
        lines += server_lines(cfg, cfg.spec, f"server of the measured spec ({cfg.spec.key()})")
    if cfg.engine.kind != cfg.deploy.target:
        lines.append(f"# note: engine={cfg.engine.kind} with deploy={cfg.deploy.target}: the manifests will run another "
                     f"engine than these trials (add deploy={cfg.engine.kind} for the same server and its precision)")
    elif cfg.engine.kind != "builtin":
        lines.append(f"# the manifests run the same argv with {PROGRAMS[cfg.engine.kind][0]}, host 0.0.0.0, "
                     f"port deploy.port and model {cfg.model.hf_id} (tuner.schema.engine_command.PLACE_FIELDS)")
    return "\n".join(lines)
