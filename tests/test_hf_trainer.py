"""FRUGAL in HF Trainer as docs/library.md shows it: which learning rate reaches the optimizer, and the
reporting helpers through accelerate's AcceleratedOptimizer (what `trainer.optimizer` is after train())."""
import pytest
import torch
import yaml
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer, TrainingArguments

import frugal
import models
from _train_helpers import REPO


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    with open(f"{REPO}/configs/model/llama_tiny.yaml") as f:
        return models.build_model(yaml.safe_load(f), vocab_size=512)


def _trainer(model, tmp_path, kwargs, **args):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", **args)
    rows = torch.randint(0, 512, (12, 16), generator=torch.Generator().manual_seed(0))
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                   optimizer_cls_and_kwargs=(frugal.FRUGAL, {"model": model, **kwargs}))


def test_training_arguments_learning_rate_does_not_reach_a_given_optimizer(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path, {}, learning_rate=0.123)
    trainer.create_optimizer()
    default = frugal.registry.defaults("frugal")["lr"]
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {default} != {0.123}
    trainer = _trainer(tiny, tmp_path, {"lr": 0.123}, learning_rate=0.5)
    trainer.create_optimizer()
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {0.123}


def test_reporting_helpers_look_through_accelerates_wrapper(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path, {"lr": 1e-3, "density": 0.25, "update_gap": 2})
    trainer.train()
    wrapped = trainer.optimizer
    assert isinstance(wrapped, AcceleratedOptimizer) and not isinstance(wrapped, frugal.FRUGAL)
    inner = wrapped.optimizer
    assert frugal.unwrap(wrapped) is inner and frugal.unwrap(inner) is inner
    assert frugal.density_report(wrapped) == inner.density_report() == {"requested": 0.25, "realised": 0.25,
                                                                          "unit": 0.25, "state_full_share": 0.25,
                                                                          "blocks": [1, 4]}
    assert frugal.state_full_fraction(wrapped) == inner.state_full_fraction() == 0.25
    assert str(frugal.describe(wrapped, model=tiny)) == str(frugal.describe(inner, model=tiny))
    assert frugal.state_bytes(wrapped) == frugal.state_bytes(inner) > 0
