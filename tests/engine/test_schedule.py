"""engine.heads.schedule, what every draft trainer shares: the prompt split (fixed text never
validates and stays in training, for Medusa heads and draft models as for EAGLE heads), the
learning-rate schedule and early stopping (whose state resumes from a checkpoint)."""

from __future__ import annotations

import pytest
import torch

from engine.heads import draft_model_train as TD
from engine.heads import medusa_train as TM
from engine.heads.data import FIXED_TEXT
from engine.heads.schedule import EarlyStop, batch_ids, epoch_steps, lr_at, split_prompts, total_steps
from tuner.schema.compose import load_config

from test_medusa import cycle_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRAIN = ["model=tiny-random", "train.steps=1", "train.batch=4", "train.seq_len=64", "train.draft_vocab=64",
         "train.warmup=1", "train.eval_fraction=0.45", "train.medusa_heads=2", "train.draft_layers=1"]


def fixed_text_data(n_seq: int = 12, answers: int = 2):
    """cycle_data whose sequences after the first `answers` are teacher-forced fixed text."""
    d = cycle_data(n_seq=n_seq, length=24)
    d.sampled[answers:] = FIXED_TEXT
    return d


def test_fixed_text_never_validates_and_stays_in_training() -> None:
    d = fixed_text_data()
    train, val = split_prompts(d, 0.45, 0)
    assert len(val) == 1 and d.sampled[val[0]] == 0  # round(0.45 * 2 answer prompts)
    assert sorted(train + val) == list(range(12)) and set(range(2, 12)) <= set(train)
    assert split_prompts(d, 0.45, 0) == (train, val) and split_prompts(d, 0.0, 0) == (list(range(12)), [])


def test_medusa_and_draft_model_train_on_every_fixed_text_sequence(engine) -> None:
    """They split as the EAGLE trainer does: before, a fixed-text prompt could be drawn for
    validation, where it was dropped (validation keeps answers only) and never trained on."""
    d = fixed_text_data()
    tc = load_config(TRAIN).train
    per_seq = len(TM.answer_positions(d, [0], 2)[0])
    _, s = TM.train_medusa(d, engine.model, "tiny-random", tc)
    assert s["train_positions"] == 11 * per_seq and s["eval_positions"] == per_seq
    _, _, s = TD.train_draft_model(d, engine.model, tc)
    assert s["train_sequences"] == 11 and s["val_sequences"] == 1


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    tc = load_config(["train.lr=1e-3", "train.warmup=4"]).train
    assert [lr_at(tc, s, 20) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    decay = [lr_at(tc, s, 20) for s in range(4, 21)]
    assert decay[0] == pytest.approx(1e-3) and decay[-1] == pytest.approx(1e-4) and decay == sorted(decay, reverse=True)
    assert lr_at(tc, 50, 20) == pytest.approx(1e-4) and lr_at(tc, 4, 20, 0.25) == pytest.approx(2.5e-4)


def test_steps_and_batches_of_an_epoch() -> None:
    tc = load_config(["train.batch=4", "train.epochs=2.5", "train.steps=100", "train.seed=3"]).train
    assert epoch_steps(10, 4) == 2 and epoch_steps(3, 4) == 1
    assert total_steps(tc, epoch_steps(10, 4)) == 5 and total_steps(tc.model_copy(update={"steps": 3}), 2) == 3
    seqs = list(range(100, 110))
    first = batch_ids(seqs, tc, 0) + batch_ids(seqs, tc, 1)
    assert len(set(first)) == 8 and set(first) <= set(seqs)  # one epoch: no sequence twice
    assert batch_ids(seqs, tc, 2) != batch_ids(seqs, tc, 0) and batch_ids(seqs, tc, 1) == batch_ids(seqs, tc, 1)


def test_early_stop_keeps_the_best_and_resumes_from_its_state() -> None:
    tc = load_config(["train.eval_every=2", "train.patience=2"]).train
    model = torch.nn.Linear(1, 1, bias=False)
    stop = EarlyStop(tc)
    losses = iter([3.0, 1.0, 1.00005, 2.0])  # 1.00005: not better by more than MIN_GAIN
    seen = []
    for step in range(1, 20):
        with torch.no_grad():
            model.weight.fill_(step)
        if stop.check(step, False, model, lambda: next(losses)):
            break
        seen.append(stop.last)
    assert step == 8 and seen == [None, 3.0, None, 1.0, None, 1.00005, None]
    assert stop.history == [(2, 3.0), (4, 1.0), (6, 1.00005), (8, 2.0)] and stop.best == 1.0
    stop.restore(model)
    assert model.weight.item() == 4.0  # the weights validated best
    again = EarlyStop(tc, stop.state)  # a resumed run: the same counters, the same best
    assert again.check(9, True, model, lambda: 5.0) and again.history[-1] == (9, 5.0)
