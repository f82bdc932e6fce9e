"""Device placement in the engine's decode path: every tensor a generation creates says where it
goes (the model's device, or the host on purpose), so nothing lands on the CPU by default when the
target is on CUDA. Checked on the CPU with the device given explicitly: a factory call without a
device (torch.tensor(...), torch.zeros(...), ...) inside engine/ during generate() fails the test."""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from engine.api import SamplingParams
from tuner.schema.compose import load_config
from tuner.study.measurer import open_engine
from tuner.schema.config import SpecConfig

FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.arange, torch.empty, torch.full, torch.randint,
             torch.rand, torch.randn, torch.as_tensor, torch.eye, torch.linspace}


class DefaultDeviceCalls(TorchFunctionMode):
    """Records engine/ call sites of tensor factories that rely on the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename.replace("\\", "/")]
            if frames:
                self.sites[f"{frames[-1].filename.rsplit('/engine/', 1)[1]}:{frames[-1].lineno}"] += 1
        return func(*args, **kwargs)


def test_generate_creates_no_tensor_on_the_default_device() -> None:
    cfg = load_config(["model=tiny-random", "engine.builtin.device=cpu", "engine.builtin.threads=1"])
    eng = open_engine(cfg)
    assert eng.device == torch.device("cpu")
    ids = eng.encode_prompt("a b c a b c a b c a b", False)
    specs = [SpecConfig(method="off"), SpecConfig(method="ngram", depth=3, topk=1, budget=4),
             SpecConfig(method="eagle", depth=3, topk=2, budget=6)]  # a tree (seeded random head)
    for spec in specs:
        eng.set_spec(spec)  # drafter construction is outside the probe: only the decode path is checked
        with DefaultDeviceCalls() as probe:
            eng.generate(ids, SamplingParams(max_new_tokens=12))
            eng.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3))
        assert not probe.sites, f"{spec.key()}: tensors created on the default device at {dict(probe.sites)}"
