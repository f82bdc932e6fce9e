"""Compose `conf/` with Hydra's compose API and validate it once into a typed `Config`.

Every user mistake (unknown group option, unknown key, wrong type, out-of-range value, an
impossible combination) becomes a `UserError` with one line naming the key and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tuner.schema.config import Config, SecretRef, UserError, WorkloadConfig

GROUPS = ("model", "hardware", "engine", "search", "deploy", "serve", "bench", "train", "distributed", "workload",
          "experiment")
# Diversity sources of head training in a fixed order (prompt selection depends on it, and so does
# the data cache key): the packaged workloads first, then any others found in conf/workload.
WORKLOAD_ORDER = ("code", "chat", "math", "json", "creative")
TRAFFIC_WORKLOADS = ("file", "mix")  # the user's own requests: no prompt set of their own


def conf_dir() -> Path:
    """The config tree: `tuner/conf` inside an installed wheel, `conf/` beside the packages in a checkout."""
    here = Path(__file__).resolve().parents[1]  # tuner/
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise UserError(f"config tree not found (looked in {here / 'conf'} and {here.parent / 'conf'})")


def available(group: str) -> list[str]:
    """Names of the options of a config group, e.g. available('workload') -> ['chat', 'code', ...]
    (a group's `_base.yaml`, the part its options share, is not one)."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml") if not p.stem.startswith("_"))


def closest(name: str, choices: typing.Iterable[str]) -> str | None:
    """The choice nearest to a mistyped `name` by edit distance (difflib), or None when none is close."""
    found = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (`X`, `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((m for a in typing.get_args(annotation) if (m := _model_of(a)) is not None), None)
    return None


def schema_model(path: list[str]) -> type[BaseModel] | None:
    """The config model at a dotted path of Config (['deploy', 'hpa'] -> HPAConfig); None when the
    path ends at a plain value, a list or a free-form mapping, or leaves the schema."""
    model: type[BaseModel] | None = Config
    for part in path:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model = _model_of(field.annotation)
    return model


def _unknown_key_line(key: str, value: str | None, overrides: list[str]) -> str:
    """One line for an override of a key the config does not have: the key it exists under when its
    group's option is not selected (engine.vllm.port needs engine=vllm), else the nearest key or
    group (did you mean), else where the valid keys are listed."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] in GROUPS and parts[1] in available(parts[0]):
        group, option = parts[:2]
        given = next((o.split("=", 1)[1] for o in overrides if _override_key(o) == group and "=" in o), None)
        try:
            _get(_hydra_composed(str(conf_dir()), (f"{group}={option}",)), parts)
        except (KeyError, UserError):
            pass
        else:
            now = f" (now {group}={given})" if given else ""
            return f"{key}: {'.'.join(parts[:2])}.* exists only with {group}={option}{now}; add {group}={option}"
    # the first part the schema does not have, under the longest path it does
    depth = next((i for i in range(1, len(parts)) if schema_model(parts[:i]) is None), len(parts))
    parent, bad = parts[:depth - 1], parts[depth - 1]
    model = schema_model(parent)
    if model is None:
        return f"{key}: unknown key (see `tuner config` for the valid keys)"
    names = list(model.model_fields)
    where = f"in {'.'.join(parent)}" if parent else "at the top level"
    near = closest(bad, [*names, *GROUPS] if not parent else names)
    if not parent and near in GROUPS:  # a mistyped group; workload and experiment are added with +
        plus = "" if near in default_groups() else "+"
        return (f"{key}: not a config group or key; did you mean {plus}{near}={value or 'NAME'}? "
                f"(groups: {', '.join(GROUPS)})")
    what = f"'{bad}' " if depth < len(parts) else ""
    hint = f"did you mean {'.'.join([*parent, near])}?" if near else f"keys {where}: {', '.join(names)}"
    return f"{key}: unknown key {what}{where}; {hint}"


def _hydra_error_line(exc: Exception, overrides: list[str]) -> str:
    msg = str(exc)
    m = re.search(r"Could not find '(\w+)/([^']+)'", msg)
    if m:
        group, opt = m.groups()
        near = closest(opt, available(group))
        hint = f"did you mean {group}={near}? " if near else ""
        return f"{group}={opt}: unknown option for group '{group}' ({hint}available: {', '.join(available(group))})"
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        if key in GROUPS:
            return (f"{key} is not in the defaults list: add it with +{key}=NAME "
                    f"(available: {', '.join(available(key))})")
        top = key.split(".")[0]
        if (top in GROUPS and top not in default_groups()
                and not any(_override_key(o) == top for o in overrides)):  # `workload.concurrency=[1,4]` alone
            return (f"{key}: no {top} is set, so it has no keys to override; add +{top}=NAME first "
                    f"(available: {', '.join(available(top))}), e.g. +{top}={available(top)[0]} {overrides_of(overrides, key)}")
        m2 = re.search(r"Key '([^']+)' is not in struct", msg)
        value = next((o.split("=", 1)[1] for o in overrides if _override_key(o) == key and "=" in o), "")
        if m2 is None and value.lstrip().startswith("{"):  # a mapping the config has: Hydra merges into it
            return (f"{key}={value}: Hydra adds no keys to an existing mapping this way; replace the whole "
                    f"mapping with ++{key}={value}, or set one entry with +{key}.NAME=VALUE")
        return _unknown_key_line(key, value, overrides)
    m = re.search(r"Could not append to config. An item is already at '([^']+)'", msg)
    if m:
        return f"+{m.group(1)}: already set; override it without '+' ({m.group(1)}=...)"
    if "appears more than once" in msg or "Multiple values for" in msg:
        return msg.splitlines()[0] + " (give each group once, without '+' for groups in the defaults)"
    first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), type(exc).__name__)
    return f"bad override ({' '.join(overrides)}): {first}"


FORMS = ("expected KEY=VALUE (spec.depth=3), KEY=[A,B] (search.methods=[ngram,eagle]) or GROUP=NAME "
         "(hardware=h100x8), one per argument")
_CLOSERS = {"[": "]", "{": "}", "(": ")"}


def _unclosed(value: str) -> str | None:
    """The first bracket or quote `value` opens and never closes (quotes hide brackets), or None."""
    stack: list[str] = []
    quote = None
    for ch in value:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _CLOSERS:
            stack.append(ch)
        elif stack and ch == _CLOSERS[stack[-1]]:
            stack.pop()
    return quote or (stack[0] if stack else None)


def override_syntax_error(override: str) -> str | None:
    """Why one command-line argument is no override Hydra can apply, as one line naming it and the
    KEY=VALUE form expected (Hydra's own text is its parser's: LexerNoViableAltException...); None
    when it parses as one value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key, eq, value = override.partition("=")
    if eq and not key.lstrip("+~").strip():
        return f"{override}: no key before '='; {FORMS}"
    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
    except HydraException:
        parsed = None
    if parsed is not None:
        if parsed.is_sweep_override():  # `spec.depth=3,4`: Hydra's multirun sweep, not one config
            first = value.split(",")[0].strip()
            return (f"{override}: a comma outside brackets is a sweep of several values, and a tuner command "
                    f"takes one: give one (e.g. {key}={first}); a list goes in brackets (search.methods=[ngram,eagle])")
        return None
    words = override.split()
    if len(words) > 1 and sum("=" in w for w in words) > 1:
        return (f"'{override}': several overrides in one argument; give each as its own argument: "
                f"{' '.join(words)} (quote only a value that holds spaces)")
    if not eq:
        if ":" in key:  # `spec.depth:3`, YAML's spelling
            return f"{override}: an override is KEY=VALUE, here {key.replace(':', '=', 1)}"
        return f"{override}: no '=VALUE'; {FORMS}"
    outside = next((ch for ch in value if not ch.isascii()), None)
    if outside is not None:
        return f"{override}: {outside!r} is not ASCII: the override syntax reads such a value only quoted ({key}='{value}')"
    if value.startswith("[") and "=" in value:
        return (f"{override}: an entry holding '=' must be quoted inside the brackets, e.g. "
                f"{key}=['--tensor-parallel-size=4']")
    opened = _unclosed(value)
    if opened:
        closer = _CLOSERS.get(opened, opened)
        return f"{override}: {opened!r} is never closed (e.g. {override}{closer}); {FORMS}"
    return f"{override}: not a value the override syntax reads; {FORMS}"


def check_override_syntax(overrides: list[str]) -> None:
    """UserError naming the first argument that is no single KEY=VALUE override."""
    for override in overrides:
        error = override_syntax_error(override)
        if error:
            raise UserError(error)


def default_groups() -> set[str]:
    """The config groups in conf/config.yaml's defaults list (the others are added with +GROUP=NAME)."""
    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text()).get("defaults", [])
    return {next(iter(d)) for d in defaults if isinstance(d, dict)}


def _validation_line(err: ValidationError, raw: dict[str, Any]) -> str:
    e = err.errors()[0]
    path = [str(p) for p in e["loc"]]
    loc = ".".join(path)
    msg = e["msg"]
    if path[:2] == ["spec", "k_per_batch_size"] and len(path) > 2:
        value = (raw.get("spec") or {}).get("k_per_batch_size")
        return (f"spec.k_per_batch_size={value}: each band is [lo, hi, K] (an inclusive concurrency range and the "
                "draft length there, integers), e.g. spec.k_per_batch_size=[[1,4,3],[5,64,1]]")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if msg.startswith("min=") and loc:  # IntRange's order: name the section's keys
            return re.sub(r"\b(min|max)=", rf"{loc}.\1=", msg)
        return msg if "=" in msg or not loc else f"{loc}: {msg}"
    if e["type"] == "extra_forbidden":
        value = e.get("input")
        return _unknown_key_line(loc, None if isinstance(value, (dict, list)) else str(value), [])
    if e["type"] == "missing":
        return f"{loc}: required key is missing"
    if e["type"] == "literal_error":
        if len(path) > 1 and path[-1].isdigit():  # a list's entry, written as the other list entries are
            loc = f"{'.'.join(path[:-1])}[{path[-1]}]"
        allowed = re.findall(r"'([^']*)'", msg)
        near = closest(str(e.get("input")), allowed)
        return f"{loc}={e.get('input')!r}: allowed: {', '.join(allowed)}" + (f"; did you mean {near}?" if near else "")
    if e["type"] == "list_type":
        value = e.get("input")
        return (f"{loc}={value!r}: a list is expected, in brackets: {loc}=[{value}] (several: "
                f"{loc}=[A,B])")
    if e["type"] == "string_type" and len(path) > 1 and path[-1].isdigit():
        key, index = ".".join(path[:-1]), path[-1]
        return (f"{key}[{index}]={e.get('input')!r}: each entry is a string: quote a number or a value with '=' "
                f"inside the brackets, e.g. {key}=[--tensor-parallel-size,'4'] or {key}=['--tensor-parallel-size=4']")
    if e["type"] in ("model_type", "dict_type") and not isinstance(e.get("input"), (dict, list)):
        # `spec=eagle`: a section given a value as if it were a config group
        value = e.get("input")
        if loc == "spec":
            from tuner.schema.spec import SpecConfig

            methods = SpecConfig.model_fields["method"].annotation.__args__  # type: ignore[union-attr]
            hint = (f"use spec.method={value}" if value in methods
                    else f"set its keys, e.g. spec.method=NAME ({', '.join(methods)})")
        elif schema_model(path) is SecretRef:
            return (f"{loc}={value}: a Secret reference has the keys name and key (the Secret and its key): "
                    f"{loc}={{name: {value}, key: token}}")
        else:
            hint = f"set its keys, e.g. {loc}.KEY=VALUE (see `tuner config`)"
        what = "a config group" if "." not in loc else "a single value"
        return f"{loc}={value}: {loc} is a section of keys, not {what}: {hint}"
    return f"{loc}={e.get('input')!r}: {msg}"


# The weight sources of a model config; hf_id is also what the manifests serve.
SOURCES = ("gguf", "local_path", "random_init")


def explicit_source(model: dict[str, Any], overrides: list[str]) -> None:
    """`model.hf_id=ORG/X` on the command line names the weights to load: it replaces the sources
    the model config file sets (conf/model/smollm2-135m.yaml's packaged GGUF), so the hub weights
    the manifests serve are the ones measured. A source also given on the command line stays (it
    loads; hf_id is then what is served, and best.yaml's provenance records both)."""
    given = {_override_key(o) for o in overrides}
    if "model.hf_id" not in given or not isinstance(model, dict):
        return
    for key in SOURCES:
        if not any(g == f"model.{key}" or g.startswith(f"model.{key}.") for g in given):
            model[key] = False if key == "random_init" else None


def compose(overrides: list[str] | None = None) -> dict[str, Any]:
    """Compose the config tree with Hydra overrides and return it as a plain dict (resolved)."""
    overrides = list(overrides or [])
    check_override_syntax(overrides)
    # an experiment preset composes after the groups it adjusts (+workload=NAME given after it
    # must not undo it); plain key=value overrides still win over both
    overrides = ([o for o in overrides if not o.lstrip("+").startswith("experiment=")]
                 + [o for o in overrides if o.lstrip("+").startswith("experiment=")])
    raw = copy.deepcopy(_hydra_composed(str(conf_dir()), tuple(overrides)))  # callers edit their copy
    explicit_source(raw.get("model"), overrides)
    return raw


@functools.lru_cache(maxsize=256)
def _hydra_composed(config_dir: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """Hydra's composition of `overrides`, once per process. The tree has no interpolations (nothing
    from the environment or the clock), so the result is a pure function of the directory and the
    overrides. A failure raises each time (lru_cache keeps none).

    Hydra composes in two stages: the group choices (`engine=vllm`, `+workload=code`) pick and merge
    the files of the defaults list, then the key overrides (`spec.depth=3`) are applied to the merged
    tree in struct mode. The first stage re-reads every file (~0.4 s here; one process composes the
    same groups again and again: each packaged workload whenever draft data is assembled, the Jobs'
    arguments while a render checks them, a catalogue of bad values); so it runs once per set of
    group choices (`_hydra_groups`), and the second stage is Hydra's own, on a copy, in the order
    given (~0.02 s). tests/tuner/test_compose.py holds the two-stage result equal to one compose."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        if any(o.key_or_group.startswith("hydra") for o in parsed):  # Hydra's own node: its one path
            cfg = _hydra_groups(config_dir, overrides, whole=True)
        else:
            # Hydra's own rule (hydra._internal.defaults_list.Overrides): an existing group given a
            # name (not a mapping) is a group choice; everything else overrides a key
            chosen = [(Path(config_dir) / o.key_or_group).is_dir() and not isinstance(o.value(), dict) for o in parsed]
            groups = [o for o, group in zip(parsed, chosen) if group]
            keys = [o for o, group in zip(parsed, chosen) if not group]
            cfg = copy.deepcopy(_hydra_groups(config_dir, tuple(o.input_line for o in groups)))
            if keys:
                from hydra._internal.config_loader_impl import ConfigLoaderImpl

                ConfigLoaderImpl._apply_overrides_to_config(keys, cfg)
        raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except UserError:
        raise
    except Exception as exc:  # Hydra/OmegaConf raise many types; all are the user's override here
        cause: BaseException | None = exc
        while cause is not None:  # Hydra wraps whatever interrupted it, a Ctrl-C included
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            cause = cause.__cause__ or cause.__context__
        raise UserError(_hydra_error_line(exc, list(overrides))) from None
    return raw  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _hydra_groups(config_dir: str, overrides: tuple[str, ...], whole: bool = False) -> Any:
    """Hydra's compose API over `overrides` (the group choices alone, or all of them with `whole`):
    the merged tree in struct mode, as Hydra applies key overrides to it. Callers copy it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def validate(raw: dict[str, Any]) -> Config:
    """Validate a composed dict into a Config, including the hardware fit check for GPU targets."""
    draft_sources = (raw.get("model") or {}).get("draft_sources")
    if isinstance(draft_sources, dict) and "mtp" in draft_sources and not draft_sources["mtp"]:
        del draft_sources["mtp"]  # a key of configs saved before it was removed (it was never read)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise UserError(_validation_line(err, raw)) from None
    # deploy.platform=lws spreads a model over several nodes: the render's fit check is over those
    # (deploy.lws.nodes_needed)
    if cfg.hardware.accelerator == "cuda" and cfg.deploy.platform != "lws":
        from tuner.schema.fit import tensor_parallel_size

        tensor_parallel_size(cfg.model, cfg.hardware, cfg.deploy)
    if cfg.engine.kind == "builtin" and cfg.hardware.accelerator == "cpu":
        from tuner.schema.fit import check_builtin_fits

        # a GPU profile is also what `tuner render deploy=vllm` names: checked where the engine runs
        # (tuner.schema.fit.check_study_fits, tuner bench)
        check_builtin_fits(cfg.model, cfg.hardware, cfg.engine.builtin)
    if cfg.workload is not None:
        packaged = packaged_names()
        bad = [p.workload for p in cfg.workload.mix if p.workload is not None and p.workload not in packaged]
        if bad:
            raise UserError(f"workload.mix: unknown workload {bad[0]!r} (allowed: {', '.join(packaged)}; or a file "
                            "part {path: PATH, weight: W})")
    if cfg.spec.adaptive and cfg.engine.kind != "builtin":
        raise UserError(f"spec.adaptive=true with engine={cfg.engine.kind}: adaptive speculation runs in the built-in "
                        "engine; allowed: engine=builtin, or spec.adaptive=false")
    if cfg.spec.adaptive and cfg.engine.builtin.forward != "lean":
        raise UserError("spec.adaptive=true needs engine.builtin.forward=lean (its step-cost curve is timed over the "
                        "lean forward); allowed: forward=lean, or spec.adaptive=false")
    if cfg.spec.method == "medusa":
        heads, source = medusa_heads(cfg)
        if cfg.spec.depth > heads:
            raise UserError(f"spec.depth={cfg.spec.depth} with spec.method=medusa: {source}, so it drafts at most "
                            f"{heads} tokens (spec.depth <= {heads})")
    return cfg


def saved_medusa_heads(path: str | Path | None) -> int | None:
    """`num_heads` of a saved Medusa head directory (engine.models.medusa_head's layout: config.json with
    model_type medusa); None when `path` is no local Medusa head (unset, a hub id, another kind).
    Read here, without torch, because `tuner render` validates configs where torch is absent."""
    if not path:
        return None
    try:
        saved = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("model_type") != "medusa" or not isinstance(saved.get("num_heads"), int):
        return None
    return saved["num_heads"]


def medusa_heads(cfg: Config, head_path: str | None = None) -> tuple[int, str]:
    """(H, why): the Medusa heads that draft for cfg, so the deepest Medusa draft is H tokens.
    The head at `head_path` (default: spec.head_path when spec.method=medusa) when it is a local
    Medusa directory; else train.medusa_heads, the heads `tuner train-draft` trains and caches for
    cfg (a hub id is not fetched to be counted: its drafter refuses a deeper spec when it loads)."""
    path = head_path or (cfg.spec.head_path if cfg.spec.method == "medusa" else None)
    n = saved_medusa_heads(path)
    if n is not None:
        where = f"spec.head_path={path}" if path == cfg.spec.head_path else f"the Medusa head at {path}"
        return n, f"{where} has {n} heads"
    return cfg.train.medusa_heads, f"train.medusa_heads={cfg.train.medusa_heads}"


def load_config(overrides: list[str] | None = None) -> Config:
    """Compose + validate: the one entry point every command uses."""
    return validate(compose(overrides))


def require_workload(cfg: Config) -> None:
    """Fail with one line listing the workloads when a command that needs one has none."""
    if cfg.workload is None:
        raise UserError(f"this command needs a workload: add +workload=NAME (available: {', '.join(available('workload'))})")


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def to_json(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2)


def save_config(cfg: Config, path: Path) -> None:
    """Write the composed, validated config (Hydra's compose API has no run dir of its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))


def load_saved_config(path: Path) -> Config:
    """Read back a config written by save_config (e.g. from a run directory)."""
    if not path.is_file():
        raise UserError(f"{path}: no such config file")
    return validate(yaml.safe_load(path.read_text()))


def overrides_of(overrides: list[str], key: str) -> str:
    """The overrides (space-separated) that set `key`."""
    return " ".join(o for o in overrides if _override_key(o) == key)


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _get(d: dict, path: list[str]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            raise KeyError(p)
        d = d[p]
    return d


def apply_overrides(saved: dict[str, Any], overrides: list[str]) -> Config:
    """A saved config (a dict, e.g. a run's config.yaml) with command-line overrides on top.

    Hydra composes the overrides on the default tree; each overridden key (or whole group, for
    `deploy=sglang`) is then copied from that composition onto the saved config.
    """
    # Compose on the saved engine's option: engine.vllm.* exists only under engine=vllm.
    given = {_override_key(o) for o in overrides}
    kind = (saved.get("engine") or {}).get("kind")
    base = [f"engine={kind}"] if kind and "engine" not in given and any(k.startswith("engine.") for k in given) else []
    composed = compose([*base, *overrides]) if overrides else {}
    for ov in overrides:
        keys = _override_key(ov).split(".")
        parent = saved
        for key in keys[:-1]:
            if not isinstance(parent.get(key), dict):
                parent[key] = {}
            parent = parent[key]
        try:
            parent[keys[-1]] = _get(composed, keys)
        except KeyError:
            parent.pop(keys[-1], None)  # `~key` deleted it
    explicit_source(saved.get("model"), overrides)
    spec = saved.get("spec")
    if (isinstance(spec, dict) and given & {"spec.depth", "spec.topk", "spec"} and "spec.budget" not in given
            and spec.get("topk", 1) in (1, "1")):
        spec["budget"] = None  # a chain's saved budget was depth+1 of the saved depth: derive it anew
    return validate(saved)


def packaged_workloads(cfg: Config) -> list[WorkloadConfig]:
    """Every packaged workload other than cfg's: diversity prompts for head training, and held-out
    sets to exclude from its data."""
    own = cfg.workload.name if cfg.workload else None
    return [w for w in (load_config([f"+workload={name}"]).workload for name in packaged_names())
            if w is not None and w.name != own]


def packaged_names() -> list[str]:
    """The packaged workloads (each a prompt set of its own), WORKLOAD_ORDER first."""
    names = [n for n in WORKLOAD_ORDER if n in available("workload")]
    return names + [n for n in available("workload") if n not in WORKLOAD_ORDER and n not in TRAFFIC_WORKLOADS]


def packaged_workload(name: str) -> WorkloadConfig:
    """The packaged workload `name` (conf/workload/NAME.yaml) as its config."""
    wl = load_config([f"+workload={name}"]).workload
    assert wl is not None
    return wl
