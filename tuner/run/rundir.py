"""A run directory: what `tuner optimize` writes (config.yaml, the study's files, best.yaml,
trials.csv, the report, k8s/) and what later commands read back from it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tuner.schema.compose import apply_overrides, load_config, load_saved_config, require_workload, save_config
from tuner.schema.config import BestResult, Config, SpecConfig, UserError
from tuner.schema.fit import check_study_fits
from tuner.study.storage import mask_url, open_storage, storage_url
from tuner.study.studies import default_study_name

if TYPE_CHECKING:
    import optuna

    from deploy.manifests import Plan
    from deploy.winner import WinnerOverride

CONFIG_FILE = "config.yaml"


def prepare_run(overrides: list[str] | None, resume: Path | None) -> tuple[Config, Path, bool]:
    """(config, run directory, is_resume). A new run saves its composed config first."""
    if resume is not None:
        if overrides:
            raise UserError(f"--resume {resume}: overrides are not allowed (the run continues its saved "
                            f"{CONFIG_FILE}); got {' '.join(overrides)}")
        cfg = load_saved_config(resume / CONFIG_FILE)
        return cfg, resume, True
    cfg = load_config(overrides)
    require_workload(cfg)
    check_study_fits(cfg)
    cfg.search.study_name = default_study_name(cfg)
    run_dir = Path(cfg.run_dir) / cfg.search.study_name
    if (run_dir / CONFIG_FILE).exists():
        raise UserError(f"{run_dir} already holds a study: continue it with --resume {run_dir} "
                        "or set search.study_name=NEW")
    save_config(cfg, run_dir / CONFIG_FILE)
    return cfg, run_dir, False


def config_for_run(run_dir: Path, overrides: Sequence[str]) -> Config:
    """The run's saved config with command-line overrides applied on top (config.apply_overrides)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{path}: no such file (tuner render --from takes a run directory of `tuner optimize`)")
    return apply_overrides(yaml.safe_load(path.read_text()), list(overrides))


def render_run(run_dir: Path, overrides: Sequence[str] = (), out: Path | None = None,
               projected: bool = False) -> tuple[Plan, list[Path]]:
    """Render a run's best.yaml into RUN_DIR/k8s (or `out`): the end of `tuner optimize`, and
    `tuner render --from RUN_DIR`. `projected`: render instead the configuration that the run's
    acceptance profile predicts best on the (overridden) hardware (tuner.projection.projector.projected_best)."""
    from deploy.render import load_best, render

    cfg = config_for_run(run_dir, list(overrides))
    given = spec_overrides(overrides)
    if projected:
        from tuner.projection.projector import projected_best

        if given:
            raise UserError(f"{' '.join(given)} with --projected: the projection picks the spec from RUN's profile; "
                            "drop --projected to serve the measured winner with these changes, or drop the spec.* "
                            "overrides")
        best: BestResult = projected_best(cfg, run_dir)
        return render(cfg, best, out or run_dir / "k8s")
    best = load_best(run_dir / "best.yaml")
    return render(cfg, best, out or run_dir / "k8s", winner_override(run_dir, best, given) if given else None)


def spec_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that change the spec (`spec.depth=5`, `spec=...`, `~spec.head_path`)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0] == "spec"]


def winner_override(run_dir: Path, best: BestResult, given: Sequence[str]) -> WinnerOverride:
    """The run's winner with the spec.* overrides `given` applied, exactly as apply_overrides applies
    them to a saved spec (a chain's budget follows a new depth); its best chain likewise, while the
    overrides leave it a chain (a vLLM render serves it for a tree)."""
    import copy

    from deploy.winner import WinnerOverride

    saved = yaml.safe_load((run_dir / CONFIG_FILE).read_text())

    def applied(spec: SpecConfig) -> SpecConfig:
        raw = copy.deepcopy(saved)
        raw["spec"] = spec.model_dump(mode="json")
        return apply_overrides(raw, list(given)).spec

    chain, chain_error = None, None
    if best.chain_spec is not None:
        try:
            chain = applied(best.chain_spec)
        except UserError as exc:  # e.g. its K schedule deeper than a new depth: refused if vLLM serves it
            chain_error = (f"{' '.join(given)} on the winner's best chain '{best.chain_spec.key()}' (what vLLM serves "
                           f"for a tree): {exc} (override it too, e.g. spec.k_per_batch_size=null)")
    return WinnerOverride(spec=applied(best.spec), chain=chain if chain is not None and chain.topk == 1 else None,
                          given=tuple(given), chain_error=chain_error)


def write_run(study: optuna.Study, cfg: Config, run_dir: Path, best: BestResult) -> None:
    """config.yaml (unless there), best.yaml, trials.csv, the report and the manifests: the files of
    every finished run, single-machine or shared."""
    from tuner.report.figures import write_report

    if not (run_dir / CONFIG_FILE).is_file():
        save_config(cfg, run_dir / CONFIG_FILE)
    write_report(study, run_dir, best, cfg)
    try:
        render_run(run_dir)
    except UserError as exc:  # e.g. a head only this machine has: the run stands, its manifests wait
        print(f"manifests not rendered: {exc}", file=sys.stderr)


def run_dir_of(path: str) -> Path:
    """A run directory given on the command line; UserError unless it holds config.yaml."""
    d = Path(path)
    if not (d / CONFIG_FILE).is_file():
        raise UserError(f"{d}: not a run directory (no {CONFIG_FILE}); give the directory `tuner optimize` printed")
    return d


def open_run_study(run_dir: Path) -> optuna.Study:
    """The study of a run directory, read from the storage its config.yaml names; UserError when
    there is none (nothing is created: a missing SQLite or journal file stays missing)."""
    import optuna

    cfg = load_saved_config(run_dir / CONFIG_FILE)
    url = storage_url(cfg.search, run_dir)
    local = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url[len("journal:"):] \
        if url.startswith("journal:") else None
    if local is not None and not Path(local).is_file():
        raise UserError(f"{run_dir}: no study there ({local} does not exist); report a run directory "
                        "`tuner optimize` wrote, or a shared study with --storage URL --study NAME")
    if not cfg.search.study_name:
        raise UserError(f"{run_dir / CONFIG_FILE}: search.study_name is not set, so no study can be read "
                        "(the config.yaml of `tuner optimize` names its study)")
    try:
        return optuna.load_study(study_name=cfg.search.study_name, storage=open_storage(url))
    except KeyError:
        raise UserError(f"{run_dir}: no study named {cfg.search.study_name!r} in {mask_url(url)}") from None
