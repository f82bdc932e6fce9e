"""The head pipeline, in order: prompts -> answers -> (features, labels) -> vocabulary -> training ->
evaluation, and the cache that makes each stage run once.

- Data (`<cache>/distill/<key>/`): key = target weights, prompt texts, chat template, answer length,
  label top-k. Shared by every head of the same target and prompts.
- Heads (`<cache>/heads/<model>-<target>/<method>-<workload>-<key>/`): key = the workload, the
  method and every training setting (data size, vocabulary, loss, steps), so changing any of them
  trains a new head instead of returning a stale one. Medusa heads and draft models
  (engine.heads.medusa_train, engine.heads.draft_model_train) are cached the same way
  (`ensure_trained`).

Everything here reads one `TrainJob`: the target, the engine settings it loads under, the workload
and the training settings (the tuner assembles it from the config).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.eagle_head import save_head
from engine.heads.answers import generate_answers, teacher_force
from engine.heads.data import DATA_FILE, DistillData
from engine.models.eagle3_head import default_aux_layers
from engine.heads.evaluate import chain_acceptance
from engine.heads.prompts import collect_prompts, fixed_code_texts
from engine.measure.workloads import encode
from engine.heads.schedule import Report, split_prompts, train_precision
from engine.heads.trainer import train_head
from engine.heads.vocab import always_kept, build_vocab
from tuner.schema.config import BuiltinEngineConfig, ModelConfig, TrainConfig, UserError, WorkloadConfig
from tuner.schema.methods import trained_by

META = "spectune_meta.json"
_DATA_SETTINGS = ("prompts", "max_new_tokens", "label_topk", "seed")


@dataclass(frozen=True)
class TrainJob:
    """What training a draft reads: the target `model`, loaded under the engine settings `builtin`
    (their weights decide the precision of its features), the `workload` whose prompts it
    learns, the `train` settings, the cache directory and the target's seed (a random_init
    target's weights)."""

    model: ModelConfig
    builtin: BuiltinEngineConfig
    workload: WorkloadConfig
    train: TrainConfig
    cache_dir: str | None = None
    seed: int = 0


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def target_hash(job: TrainJob) -> str:
    """Identity of the target's weights (and of the precision its features are computed in)."""
    from engine.models.machine import cache_root
    from engine.models.target import file_digest, gguf_path, resolve_device, resolve_weights

    m, root = job.model, cache_root(job.cache_dir)
    if m.random_init:
        basis = f"random:{m.model_dump_json()}:{job.seed}"
    elif m.local_path:
        p = Path(m.local_path).expanduser()
        weights = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin"))
        basis = "local:" + ",".join(file_digest(w, root) for w in weights) if weights else f"local:{p.resolve()}"
    elif m.gguf is not None:
        basis = "gguf:" + file_digest(gguf_path(m.gguf.package, m.gguf.file), root)
    else:
        basis = f"hub:{m.hf_id}"
    # the format the target computes in here (auto resolved: answers of an fp32 and a bf16 target
    # differ); fp32 keyed as before, so heads trained then are found again
    w = resolve_weights(job.builtin, m, resolve_device(job.builtin.device), job.cache_dir, job.seed)
    return _short(f"{basis}:fp8=False" if w == "fp32" else f"{basis}:weights={w}")


def data_key(thash: str, prompts: Sequence, chat_template: bool, tc: TrainConfig,
             aux_layers: Sequence[int] | None = None) -> str:
    """Identity of a data set: target, prompt texts, chat template, the answer settings and the
    target layers whose states it keeps (EAGLE-3)."""
    settings = {k: getattr(tc, k) for k in _DATA_SETTINGS}
    if tc.answers_per_prompt > 1:  # greedy answers alone keep the key they had before sampled ones existed
        settings.update(answers_per_prompt=tc.answers_per_prompt, answer_temperature=tc.answer_temperature)
    basis = [thash, [p.text for p in prompts], chat_template, settings]
    if aux_layers:
        basis.append([int(k) for k in aux_layers])
    return _short(json.dumps(basis))


def head_key(job: TrainJob, method: str) -> str:
    """Identity of a head: workload, method and every training setting, the precision as it resolves
    on this machine (a fixed-text supplement that is off and fp32 training are left out, so heads
    trained before those settings existed keep their key)."""
    skip = {"checkpoint_every", "precision"} | ({"fixed_text_tokens"} if not job.train.fixed_text_tokens else set())
    if job.train.answers_per_prompt == 1:  # no sampled answers: the key of heads trained before they existed
        skip |= {"answers_per_prompt", "answer_temperature"}
    train = job.train.model_dump(mode="json", exclude=skip)
    precision = train_precision(job.train, "cuda" if job.builtin.device != "cpu" and torch.cuda.is_available() else "cpu")
    if precision != "fp32":
        train["precision"] = precision
    return _short(json.dumps([job.workload.model_dump(mode="json"), method, train], sort_keys=True))


def head_dir(job: TrainJob, method: str = "eagle") -> Path:
    """Where the draft of `method` for (target, workload, training settings) lives (every trained
    method: EAGLE heads, Medusa heads, draft models)."""
    from engine.models.machine import cache_root

    return (cache_root(job.cache_dir) / "heads" / f"{job.model.name}-{target_hash(job)}"
            / f"{method}-{job.workload.name}-{head_key(job, method)}")


def cached_head(job: TrainJob, method: str = "eagle") -> Path | None:
    """The finished draft of `method` for the job, if one was trained."""
    out = head_dir(job, method)
    return out if (out / META).is_file() else None


def build_data(job: TrainJob, engine, workloads: Sequence[WorkloadConfig] = (), report: Report | None = None,
               aux_layers: Sequence[int] | None = None) -> DistillData:
    """Stages 1-2: the training prompts and the target's answers with features and labels (cached);
    with `aux_layers` also the inputs of those target layers (EAGLE-3). Every trainer's data."""
    from engine.models.machine import cache_root

    tc = job.train
    thash = target_hash(job)
    prompts = collect_prompts(job.workload, workloads, tc.prompts, tc.seed)
    if not prompts:
        raise UserError("train-draft: no training prompts (all were held out?)")
    chat = job.workload.chat_template
    key = data_key(thash, prompts, chat, tc, aux_layers)
    path = cache_root(job.cache_dir) / "distill" / key
    if (path / DATA_FILE).is_file():
        data = DistillData.load(path)
    else:
        data = _answer_data(job, engine, prompts, key, thash, path, report, aux_layers, workloads)
    if tc.fixed_text_tokens:
        data = DistillData.concat([data, _fixed_text_data(job, engine, thash, report, aux_layers)])
    return data


def _answer_data(job: TrainJob, engine, prompts: Sequence, key: str, thash: str, path: Path, report: Report | None,
                 aux_layers: Sequence[int] | None, workloads: Sequence[WorkloadConfig]) -> DistillData:
    """The target's answers to the prompts (stage 2), saved at path."""
    tc, chat = job.train, job.workload.chat_template

    def progress(done: int, total: int, tokens: int, seconds: float) -> None:
        if report:
            report("generate", done, total, {"tokens": tokens, "tok_s": tokens / max(seconds, 1e-9)})

    encoded = [encode(engine, p, chat) for p in prompts]  # a file's request: its own turns
    n = tc.answers_per_prompt  # the greedy answer of every prompt, then n - 1 sampled ones of each
    data = generate_answers(engine.forward, encoded * n, tc.max_new_tokens, engine.eos, tc.gen_batch, tc.label_topk,
                            aux_layers=aux_layers, prompt_idx=list(range(len(encoded))) * n, on_progress=progress,
                            meta={"key": key, "target": thash, "sources": _sources(prompts),
                                  "workloads": [job.workload.name, *[w.name for w in workloads]],
                                  "answers_per_prompt": n, "answer_temperature": tc.answer_temperature if n > 1 else 0.0},
                            temperatures=None if n == 1 else [0.0] * len(encoded) + [tc.answer_temperature] * (len(encoded) * (n - 1)),
                            seed=tc.seed)
    data.meta["prompts"] = len(encoded)  # distinct prompts; `sequences` counts every answer
    data.save(path)
    return data


def _fixed_text_data(job: TrainJob, engine, thash: str, report: Report | None,
                     aux_layers: Sequence[int] | None) -> DistillData:
    """The teacher-forced supplement (cached): stdlib sources as replies to their own tasks, taken
    in a seeded order until train.fixed_text_tokens reply tokens; each sequence fits train.seq_len."""
    from engine.models.machine import cache_root

    tc, chat, tok = job.train, job.workload.chat_template, engine.tokenizer
    end = [tok.eos_token_id] if tok.eos_token_id is not None else []
    seqs, texts, total = [], [], 0
    for task, reply in fixed_code_texts(tc.seed):
        p = engine.encode_prompt(task.text, chat)
        room = tc.seq_len - len(p)
        if room < 16 or total >= tc.fixed_text_tokens:
            continue
        r = (tok.encode(reply, add_special_tokens=False) + end)[:min(room, tc.fixed_text_tokens - total)]
        seqs.append((p, r))
        texts.append(task.id)
        total += len(r)
    key = _short(json.dumps([thash, "fixed-text", texts, chat, tc.seq_len, tc.label_topk, tc.fixed_text_tokens,
                             [int(k) for k in aux_layers or []]]))
    path = cache_root(job.cache_dir) / "distill" / key
    if (path / DATA_FILE).is_file():
        return DistillData.load(path)

    def progress(done: int, n: int, tokens: int, seconds: float) -> None:
        if report:
            report("fixed text", done, n, {"tokens": tokens, "tok_s": tokens / max(seconds, 1e-9)})

    # a prefill row is a whole sequence (up to seq_len tokens), not one token: a quarter of the
    # decode batch keeps the activations of one forward about the same size
    data = teacher_force(engine.model, seqs, tc.label_topk, tc.gen_batch // 4 or 1, aux_layers,
                         on_progress=progress, meta={"key": key, "target": thash})
    data.save(path)
    return data


def _sources(prompts: Sequence) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in prompts:
        s = p.source.split("/")[0]
        out[s] = out.get(s, 0) + 1
    return out


def open_engine(job: TrainJob, engine=None):
    """`engine` when given, else the built-in engine over the job's target, speculation off."""
    if engine is not None:
        return engine
    from engine.decode.loop import Engine

    return Engine.from_config(job.model, job.builtin, cache_dir=job.cache_dir, seed=job.seed)


def ensure_trained(job: TrainJob, method: str, train: Callable[[Any, DistillData], tuple[Callable[[Path], Any], dict]],
                   engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                   report: Report | None = None, aux_layers: Callable[[Any], Sequence[int] | None] = lambda e: None,
                   work: Path | None = None) -> Path:
    """The draft directory of `method` for the job: cached, or trained now (retrain=True trains
    again, reusing generated data). `train(engine, data)` trains on the self-distillation data
    (with the states of the target layers `aux_layers(engine)` names) and returns (save, summary):
    save(out) writes the draft into `out`, summary goes into its meta. The meta is written last, so
    a directory without one (an interrupted save) is never taken for a finished draft. `work` is
    the directory of a run's checkpoints, removed when a retrain starts and when the draft is saved."""
    out = head_dir(job, method)
    if not retrain and (out / META).is_file():
        return out
    if retrain:
        (out / META).unlink(missing_ok=True)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    engine = open_engine(job, engine)
    t0 = time.perf_counter()
    data = build_data(job, engine, workloads, report, aux_layers(engine))
    data_s = time.perf_counter() - t0  # the answers when made now, else loading them
    save, summary = train(engine, data)
    if out.exists():
        shutil.rmtree(out)
    save(out)
    meta = {"target": job.model.name, "target_hash": target_hash(job), "workload": job.workload.name,
            "method": method, "data": dict(data.meta), "train": job.train.model_dump(mode="json"),
            "seed": job.train.seed, **summary, "data_seconds": round(data_s, 1),
            "total_seconds": round(time.perf_counter() - t0, 1)}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return out


def ensure_head(job: TrainJob, engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                report: Report | None = None, method: str = "eagle") -> Path:
    """The EAGLE / EAGLE-3 head directory for the job: the cached one, or a newly trained one
    (retrain=True trains again, reusing generated data). `workloads` are the other packaged
    workloads: their held-out prompts are excluded from the data too."""
    if method not in trained_by("eagle"):
        raise UserError(f"spec.method={method}: this pipeline trains {' and '.join(trained_by('eagle'))} heads")
    out = head_dir(job, method)
    work = out.parent / f".{out.name}.work"  # checkpoints of a run in progress
    tc = job.train

    def train(engine, data: DistillData):
        head, summary = train_eagle_head(engine, data, tc, method, work, report)
        if method == "eagle3":
            from engine.models.eagle3_head import save_eagle3

            return (lambda out: save_eagle3(head, out)), summary
        return (lambda out: save_head(head, out)), summary

    return ensure_trained(job, method, train, engine, retrain, workloads, report,
                          lambda e: head_aux_layers(e, method), work)


def head_aux_layers(engine, method: str) -> Sequence[int] | None:
    """The target layers whose states a head of `method` reads besides the last (EAGLE-3), else None."""
    return default_aux_layers(engine.model.config.num_hidden_layers) if method == "eagle3" else None


def train_eagle_head(engine, data: DistillData, tc: TrainConfig, method: str, work: Path,
                     report: Report | None = None, topk: int = 1, max_nodes: int = 64) -> tuple[torch.nn.Module, dict]:
    """Stages 3-5 on `data`: the draft vocabulary, an EAGLE-1 / EAGLE-3 head trained under `tc`
    (checkpoints in `work`) and its offline acceptance on the validation prompts (with `topk` > 1
    also a tree's of that top-k: engine.heads.evaluate); (head, summary)."""
    vocab_size = engine.model.get_output_embeddings().weight.shape[0]
    vocab = build_vocab(data, tc.draft_vocab, vocab_size, always_kept(engine.tokenizer, vocab_size, sorted(engine.eos)))
    head, summary = train_head(data, engine.model, tc, vocab, work, report, method)
    _, val = split_prompts(data, tc.eval_fraction, tc.seed)
    summary.update(evaluate_head(head, engine.model, vocab, data, val, tc.seq_len, topk, max_nodes))
    summary.update(draft_vocab=0 if vocab is None else len(vocab.ids),
                   draft_vocab_coverage=1.0 if vocab is None else round(vocab.coverage(data.response_labels()), 4))
    return head, summary


def evaluate_head(head: torch.nn.Module, target: torch.nn.Module, vocab, data: DistillData, seqs: Sequence[int],
                  seq_len: int, topk: int = 1, max_nodes: int = 64) -> dict:
    """Offline T=0 chain acceptance of a trained EAGLE-1 or EAGLE-3 head on `seqs` (stage 5)."""
    from engine.models.eagle_head import EagleHead
    from engine.heads.trainer import Eagle1Net, Eagle3Net

    embed = target.get_input_embeddings().weight.detach().float()
    if isinstance(head, EagleHead):
        lm = target.get_output_embeddings().weight.detach().float()
        ids = None if vocab is None else vocab.ids
        net = Eagle1Net(head, lm if ids is None else lm[ids.to(lm.device)])
    else:
        net, ids = Eagle3Net(head), head.target_ids()
    return chain_acceptance(net, embed, ids, data, seqs, seq_len, topk=topk, max_nodes=max_nodes)


def read_meta(path: str | Path) -> dict:
    """The spectune metadata of a trained head directory."""
    p = Path(path) / META
    if not p.is_file():
        raise UserError(f"{path}: no {META} (not a head trained by tuner train-draft)")
    return json.loads(p.read_text())
